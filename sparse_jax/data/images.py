"""Folders of pictures as image datasets: any folder (searched recursively) of same-size PNG or
JPEG pictures, decoded once into a cached uint8 array.

  folder = load_folder(path, split_fractions)  # a Folder: shape, layout, splits
  folder.splits["test"].images(idx)            # uint8 [len(idx), H * W * C], raster order

- Pictures are the files ending in .png, .jpg or .jpeg (any case) in the folder and its
  subfolders, in name order; class subfolders are only folders (labels are not used). Other
  files, and names starting with ".", are skipped. H, W and C come from the pictures, which
  must share one size and one channel count (1 grayscale, 2 grayscale + alpha, 3 RGB, 4 RGBA;
  palette, CMYK and YCbCr pictures are read as RGB).
- Splits. With `train/` and `test/` subfolders: those, and `valid/` if present, else
  `split_fractions[1]` of the train/ pictures held out with the fixed SPLIT_SEED (as CIFAR-10's
  2,000 of 50,000: `configs/images.py` sets 0.04). Without them: a permutation of all pictures
  drawn with SPLIT_SEED, cut by `split_fractions` (train, valid, test). Each split keeps name
  order. The split of the latest load is recorded in the cache folder's `split.json` (which
  picture went where), and a run records its own in its data fingerprint (`fingerprint`).
- Cache: `<folder>.sparse_jax/pixels.npy`, next to the folder: uint8 [N, H, W, C], every picture
  in name order, written once (atomically) and vouched for in `pixels.npy.verified` with the
  machinery of the byte corpus (`sources.vouch`), keyed by the folder's listing (each picture's
  name, size and mtime) and the cache file's own size and mtime. A later load maps it without
  decoding anything; an added, removed or modified picture makes the next load decode again.
- Errors. Every picture's header is read before anything is decoded, so a missing or empty
  folder, an unreadable file, mixed sizes and mixed channels (a grayscale picture among RGB
  ones) fail within seconds in one line that names the file and the fix (ValueError; OSError
  for what cannot be read or written). A picture damaged past its header fails the same way
  while decoding, before the cache is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Callable

import numpy as np

from sparse_jax.data import sources
from sparse_jax.data.sources import SPLITS
from sparse_jax.files import atomic_write, part_suffix

EXTENSIONS = (".png", ".jpg", ".jpeg")  # compared in lower case
CACHE_SUFFIX = ".sparse_jax"  # the cache folder: <folder>.sparse_jax, next to the folder
SPLIT_SEED = 0  # fixed: the split never depends on the run's seed
# Pillow's mode -> (channels, the mode the pixels are read in).
MODES = {"1": (1, "L"), "L": (1, "L"), "LA": (2, "LA"), "P": (3, "RGB"), "RGB": (3, "RGB"),
         "YCbCr": (3, "RGB"), "CMYK": (3, "RGB"), "RGBA": (4, "RGBA")}
KINDS = {1: "grayscale", 2: "grayscale + alpha", 3: "RGB", 4: "RGBA"}
READ_MODE = {channels: mode for channels, mode in MODES.values()}


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSplit:
    """Random access to one split, in the interface of `Cifar10Source`."""

    # uint8 [N, H, W, C]: every picture of the folder (a read-only memory map)
    pixels: np.ndarray = dataclasses.field(repr=False)
    rows: np.ndarray = dataclasses.field(repr=False)  # int64 [n]: this split's rows of `pixels`
    files: tuple[str, ...] = dataclasses.field(repr=False)  # its pictures ("/"-separated paths)

    def __len__(self) -> int:
        return len(self.rows)

    def images(self, idx) -> np.ndarray:
        """uint8 [len(idx), H * W * C] in raster order (row, column, channel)."""
        rows = self.rows[np.asarray(idx, np.int64)]
        return np.asarray(self.pixels[rows]).reshape(len(rows), -1)


@dataclasses.dataclass(frozen=True, eq=False)
class Folder:
    """A loaded folder of pictures."""

    path: str  # the folder, absolute
    shape: tuple[int, int, int]  # (rows H, columns W, channels C) of every picture
    layout: str  # "folders" (train/ and test/ subfolders) or "seeded" (a fixed-seed split)
    splits: dict[str, ImageSplit] = dataclasses.field(repr=False)  # "train", "valid", "test"
    decoded: bool  # whether this load decoded the pictures (False: mapped from the cache)
    seconds: float  # how long this load took
    cache: str  # the cache folder


def cache_dir(path: str) -> str:
    """The cache folder of the picture folder `path`: `<path>.sparse_jax`, next to it."""
    return os.path.abspath(os.path.expanduser(os.fspath(path))).rstrip(os.sep) + CACHE_SUFFIX


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _require_folder(folder: str) -> None:
    fix = "set --config.data.path to a folder of PNG or JPEG pictures"
    if not os.path.exists(folder):
        raise FileNotFoundError(f"image folder {folder} not found; {fix}")
    if not os.path.isdir(folder):
        raise NotADirectoryError(f"image folder {folder} is a file, not a folder; {fix}")


def _list(folder: str) -> tuple[list[str], list[tuple[int, int]], int]:
    """(pictures relative to `folder` in name order, their (size, mtime_ns), other files)."""
    def cannot_list(e):
        raise OSError(e.errno, f"cannot list {e.filename} ({e.strerror}); make it readable "
                               f"(chmod u+rx) or move it out of {folder}") from e

    found, others = [], 0
    for root, dirs, names in os.walk(folder, onerror=cannot_list):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if name.startswith("."):
                continue
            if not name.lower().endswith(EXTENSIONS):
                others += 1
                continue
            path = os.path.join(root, name)
            stat = os.stat(path)
            kind = sources.not_regular(stat.st_mode)  # a FIFO would block the reader: never open
            if kind:
                raise ValueError(f"{path} is {kind}, not a picture file; move it out of "
                                 f"{folder}, or save the picture it stands for as a file")
            found.append((os.path.relpath(path, folder).replace(os.sep, "/"),
                          (stat.st_size, stat.st_mtime_ns)))
    found.sort()
    return [f for f, _ in found], [k for _, k in found], others


def _layout(folder: str, files: list[str], others: int) -> str:
    """"folders" or "seeded"; a one-line ValueError for a folder without pictures, a train/
    without test/ (or the reverse), an empty split folder or a picture outside the split
    folders."""
    where = f"{folder} and its subfolders"
    if not files:
        seen = f" (it holds {others} other files)" if others else ""
        raise ValueError(f"no PNG or JPEG pictures in {where}{seen}; set --config.data.path to "
                         "a folder of .png, .jpg or .jpeg pictures")
    present = [s for s in SPLITS if os.path.isdir(os.path.join(folder, s))]
    if not {"train", "test"} & set(present):
        return "seeded"
    if not {"train", "test"} <= set(present):
        has, lacks = ("train", "test") if "train" in present else ("test", "train")
        raise ValueError(f"{folder} has a {has}/ folder but no {lacks}/: add {lacks}/ to split "
                         f"by folders, or rename {has}/ to split every picture with a fixed seed")
    for rel in files:
        if rel.split("/", 1)[0] not in present:
            raise ValueError(f"{os.path.join(folder, rel)} lies outside {folder}'s "
                             f"{'/, '.join(present)}/ folders, which split the data; move it "
                             "into one of them, or out of the folder")
    for split in present:
        if not any(rel.startswith(split + "/") for rel in files):
            raise ValueError(f"no PNG or JPEG pictures in {os.path.join(folder, split)}; add "
                             f"some, or remove the empty {split}/ folder")
    return "folders"


def _split(layout: str, files: list[str], fractions) -> dict[str, np.ndarray]:
    """Rows of each split (see the module docstring), each in name order."""
    n = len(files)
    if layout == "seeded":
        perm = np.random.default_rng(SPLIT_SEED).permutation(n)
        cuts = np.round(np.cumsum(fractions)[:2] * n).astype(int)
        return dict(zip(SPLITS, (np.sort(p) for p in np.split(perm, cuts))))
    top = np.array([rel.split("/", 1)[0] for rel in files])
    rows = {s: np.flatnonzero(top == s) for s in SPLITS}
    if not len(rows["valid"]):  # no valid/ folder: hold out a share of train/
        train = rows["train"]
        keep = len(train) - int(round(fractions[1] * len(train)))
        perm = np.random.default_rng(SPLIT_SEED).permutation(len(train))
        rows["train"], rows["valid"] = np.sort(train[perm[:keep]]), np.sort(train[perm[keep:]])
    return rows


def _open(path: str, folder: str):
    """The picture at `path` opened with Pillow (header only), or a one-line error."""
    from PIL import Image

    try:
        return Image.open(path)
    except PermissionError as e:
        raise OSError(e.errno, f"cannot read picture {path} ({e.strerror}); make it readable "
                               f"(chmod u+r) or move it out of {folder}") from e
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"{path} is not a readable PNG or JPEG picture ({_one_line(e)}); "
                         f"replace it, or move it out of {folder}") from e


def _check_headers(folder: str, files: list[str]) -> tuple[int, int, int]:
    """(H, W, C) shared by every picture, read from the headers (nothing decoded)."""
    first = None
    for rel in files:
        path = os.path.join(folder, rel)
        with _open(path, folder) as image:
            (w, h), mode = image.size, image.mode
        if mode not in MODES:
            raise ValueError(f"{path} has pixels of mode {mode}, not 8-bit grayscale, RGB or "
                             "RGBA; save it as 8-bit RGB (Pillow: Image.open(p).convert('RGB')"
                             f".save(p)), or move it out of {folder}")
        c = MODES[mode][0]
        if first is None:
            first = (path, h, w, c)
            continue
        path0, h0, w0, c0 = first
        if (h, w) != (h0, w0):
            raise ValueError(f"pictures in {folder} differ in size: {path} is {w}x{h} (width x "
                             f"height), {path0} is {w0}x{h0}; all must have one size: resize or "
                             "crop them to one (Pillow: Image.resize), or move the others out")
        if c != c0:
            raise ValueError(f"{path} is {KINDS[c]} ({c} channel{'s' * (c > 1)}, mode {mode}) "
                             f"among {KINDS[c0]} pictures ({c0}, e.g. {path0}); all need the "
                             f"same channels: convert it (Pillow: Image.open(p).convert("
                             f"'{READ_MODE[c0]}').save(p)), or move it out of {folder}")
    return first[1], first[2], first[3]


def _decode(path: str, folder: str, shape: tuple[int, int, int]) -> np.ndarray:
    """uint8 [H, W, C] of one picture; a one-line ValueError if it cannot be decoded (so that
    every OSError while the cache is written comes from writing)."""
    from PIL import Image

    h, w, c = shape
    try:
        with Image.open(path) as image:
            pixels = np.asarray(image if image.mode == READ_MODE[c] else
                                image.convert(READ_MODE[c]), np.uint8)
    except PermissionError as e:
        raise ValueError(f"cannot read picture {path} ({e.strerror}); make it readable (chmod "
                         f"u+r) or move it out of {folder}") from e
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"{path} is damaged: its pixels cannot be decoded ({_one_line(e)}); "
                         f"replace it, or move it out of {folder}") from e
    if pixels.size != h * w * c:
        raise ValueError(f"{path} decodes to {pixels.shape}, not {shape}; save it again as a "
                         f"plain PNG, or move it out of {folder}")
    return pixels.reshape(h, w, c)


def _cached(npy: str, key: dict, count: int) -> np.ndarray | None:
    """The cache as a read-only memory map if it is vouched for with `key`, else None; a file
    at the cache's path that this module did not write is never replaced."""
    if not os.path.exists(npy):
        return None
    if sources.vouched(npy, {**key, **sources.file_key(npy)}):
        try:
            pixels = np.load(npy, mmap_mode="r")
        except (OSError, ValueError):
            return None
        if pixels.dtype == np.uint8 and pixels.ndim == 4 and len(pixels) == count:
            return pixels
    elif not os.path.exists(npy + ".verified"):
        raise ValueError(f"{npy} exists but was not written by sparse_jax for "
                         f"{os.path.dirname(npy)[:-len(CACHE_SUFFIX)]}; move it away")
    return None  # a cache of another version of the folder: decoded again


def _write_cache(folder: str, files: list[str], shape, npy: str, key: dict) -> np.ndarray:
    """Decodes every picture straight into `npy` (no copy of the whole array in memory) and
    vouches for it before it appears under its name; returns it as a memory map."""
    header = {"descr": "|u1", "fortran_order": False, "shape": (len(files), *shape)}
    try:
        os.makedirs(os.path.dirname(npy), exist_ok=True)
        with atomic_write(npy, "wb", suffix=part_suffix(npy)) as f:
            np.lib.format.write_array_header_1_0(f, header)
            for rel in files:
                f.write(_decode(os.path.join(folder, rel), folder, shape).tobytes())
            f.flush()  # the rename keeps the size and mtime the key records
            sources.vouch(npy, {**key, **sources.file_key(f.name)})
    except OSError as e:  # `_decode` raises ValueErrors: an OSError here comes from writing
        raise OSError(e.errno, f"cannot write the decoded pictures of {folder} to {npy} "
                               f"({e.strerror or e}); free some space, or make "
                               f"{os.path.dirname(os.path.dirname(npy))} writable, or copy the "
                               "pictures to a writable place") from e
    return np.load(npy, mmap_mode="r")


def _record_split(cache: str, record: dict) -> None:
    """Writes the split to `<cache>/split.json` unless it holds it already (best effort: a
    read-only cache folder records nothing)."""
    path = os.path.join(cache, "split.json")
    try:
        with open(path) as f:
            if json.load(f) == record:
                return
    except (OSError, ValueError):
        pass
    try:
        with atomic_write(path, suffix=part_suffix(path)) as f:
            json.dump(record, f, indent=0)
    except OSError:
        pass


def _cache_key(files: list[str], keys: list[tuple[int, int]]) -> dict:
    """What the decoded cache must have been made from: every picture's name, size and mtime."""
    listing = hashlib.sha256("".join(f"{rel}\0{size}\0{mtime}\n" for rel, (size, mtime)
                                     in zip(files, keys)).encode()).hexdigest()
    return {"listing_sha256": listing, "pictures": len(files)}


def folder_shape(path: str) -> tuple[int, int, int]:
    """(H, W, C) of the pictures in `path`: the decoded cache's when it is current, else read
    from every picture's header (nothing decoded); the same one-line errors as `load_folder`."""
    folder = os.path.abspath(os.path.expanduser(os.fspath(path))).rstrip(os.sep) or os.sep
    _require_folder(folder)
    files, keys, others = _list(folder)
    _layout(folder, files, others)  # no pictures, or train/ without test/: its one line
    pixels = _cached(os.path.join(cache_dir(folder), "pixels.npy"), _cache_key(files, keys),
                     len(files))
    return tuple(pixels.shape[1:]) if pixels is not None else _check_headers(folder, files)


FROM_PICTURES = ()  # model.image_shape of a preset that takes the shape from its pictures


def check_model_shape(what: str, shape, seq_len: int, model_shape=None, fix: str = "") -> None:
    """A one-line ValueError, with the overrides that fix it (or `fix`), unless images of
    `shape` (`what`: "the pictures in FOLDER", ...) are what a model of `seq_len` sub-pixels
    (and `model_shape`, if given) reads."""
    (h, w, c), size = shape, int(np.prod(shape))
    if seq_len == size and model_shape in (None, tuple(shape)):
        return
    reads = f"seq_len={seq_len}" + (f", image_shape={tuple(model_shape)}" if model_shape else "")
    raise ValueError(f"{what} are {h} x {w} x {c} (rows x columns x channels) = {size} "
                     f"sub-pixels, but the model reads {reads}: " + (fix or (
                         f"set --config.model.seq_len={size} --config.model.image_shape="
                         f"({h},{w},{c}) (and a strided pattern's stride to one row: "
                         f"--config.model.stride={w * c})")))


def fill_model_shape(config) -> str | None:
    """For a picture-folder run (configs/images.py) whose model fields are left to the pictures:
    image_shape ``FROM_PICTURES`` becomes the pictures' (H, W, C), a seq_len of 0 H·W·C, a stride
    of 0 one row of sub-pixels (W·C) and a summary width c of 0 a quarter of the stride (the
    paper's l and c for CIFAR-10). Returns the line that says what it chose, or None when there
    was nothing to choose. Fields the user set (``--config.model.*``) are kept; before anything
    is announced they are checked against the pictures (`check_model_shape`: a one-line
    ValueError for a shape the folder does not hold), and by the model and the data as usual."""
    model = config.model
    if config.data.name != "images" or not (tuple(model.image_shape) == FROM_PICTURES
                                            or 0 in (model.seq_len, model.stride, model.c)):
        return None
    taken = tuple(model.image_shape) == FROM_PICTURES
    if taken and not config.data.path:
        raise ValueError("this config takes the model's picture shape from the pictures: "
                         "give --config.data.path=FOLDER (or set --config.model.image_shape"
                         "=(H,W,C) and --config.model.seq_len=H*W*C)")
    pictures = folder_shape(config.data.path) if config.data.path else None
    chosen = {"image_shape": pictures} if taken else {}
    h, w, c = chosen.get("image_shape") or tuple(model.image_shape)
    if not model.seq_len:
        chosen["seq_len"] = h * w * c
    if not model.stride:
        chosen["stride"] = w * c
    if not model.c:
        chosen["c"] = max(1, (chosen.get("stride") or model.stride) // 4)
    if pictures is not None:  # what the user set, against the pictures (the data checks again)
        ph, pw, pc = pictures
        right = {"image_shape": f"({ph},{pw},{pc})", "seq_len": ph * pw * pc}
        given = [k for k in right if k not in chosen]  # set by the user
        check_model_shape(f"the pictures in {config.data.path}", pictures,
                          chosen.get("seq_len", model.seq_len), (h, w, c),
                          f"leave {' and '.join(f'--config.model.{k}' for k in given)} out to "
                          "take the pictures' shape, or set "
                          + " ".join(f"--config.model.{k}={right[k]}" for k in given))
    for name, value in chosen.items():
        model[name] = value
    fields = ", ".join(f"model.{k}={v}" for k, v in chosen.items())
    return (f"pictures of {h}x{w}x{c} (rows x columns x channels): {fields} (set them with "
            "--config.model.* to choose others)")


def load_folder(path: str, split_fractions=(0.9, 0.05, 0.05),
                check_shape: Callable[[tuple[int, int, int]], None] | None = None) -> Folder:
    """The pictures of `path` (module docstring): mapped from the cache, or decoded into it.

    `check_shape(shape)` runs as soon as (H, W, C) is known, before anything is decoded (the
    data layer refuses a model of another shape there). Every error is one line naming the
    folder or the file and the fix."""
    start = time.time()
    folder = os.path.abspath(os.path.expanduser(os.fspath(path))).rstrip(os.sep) or os.sep
    _require_folder(folder)
    files, keys, others = _list(folder)
    layout = _layout(folder, files, others)
    key = _cache_key(files, keys)
    cache = cache_dir(folder)
    if os.path.exists(cache) and not os.path.isdir(cache):
        raise NotADirectoryError(f"{cache}, where the decoded pictures of {folder} are cached, "
                                 "is a file; move it away")
    npy = os.path.join(cache, "pixels.npy")
    pixels = _cached(npy, key, len(files))
    decoded = pixels is None
    shape = _check_headers(folder, files) if decoded else tuple(pixels.shape[1:])
    if check_shape is not None:
        check_shape(shape)
    if decoded:
        pixels = _write_cache(folder, files, shape, npy, key)
    rows = _split(layout, files, split_fractions)
    splits = {s: ImageSplit(pixels, r, tuple(files[i] for i in r)) for s, r in rows.items()}
    _record_split(cache, {"folder": folder, "layout": layout, "split_seed": SPLIT_SEED,
                          "split_fractions": list(split_fractions), "shape": list(shape),
                          "splits": {s: list(split.files) for s, split in splits.items()}})
    return Folder(folder, shape, layout, splits, decoded, time.time() - start, cache)


def fingerprint(folder: Folder) -> dict:
    """What identifies the data of a run on `folder`: the pixels of every split in split order
    (so also which picture is in which split), hashed in full, with the shape, layout, split
    seed and split sizes (`sources.stream_fingerprint`, `sources.check_unchanged`)."""
    parts = [folder.splits[s].images(np.arange(len(folder.splits[s]))) for s in SPLITS]
    return {**sources.stream_fingerprint("images", folder.path, parts),
            "shape": list(folder.shape), "layout": folder.layout, "split_seed": SPLIT_SEED,
            "num_images": {s: len(folder.splits[s]) for s in SPLITS}}
