"""Figures a model's bits should be read against.

Pictures (`scripts/image_baselines.py`): what general-purpose lossless image codecs cost on a
split of a folder of pictures, in bits per dim. Byte streams (`repeat_reach`,
`scripts/repeats.py`): how much of a split exact copying could predict at each context length,
the ceiling of what a longer context can buy a model that copies; and what general-purpose
compressors pay for a split given everything before it (`compressor_bits`), the figure a
model's test bits/byte are held against.

Each picture is compressed alone (as a file of its own would be) by

  png   Pillow's PNG writer with optimize=True (zlib at its best setting, filters chosen)
  webp  lossless WebP (lossless=True, quality=100, method=6: the slowest, smallest)

and decoded again to check that it is lossless. Bits per dim = 8 x total bytes / total
sub-pixels of the pictures (H x W x C each), so a codec's file headers count, as they would for
files on a disk. The pictures are read as the model reads them (`sparse_jax.data.images`): on a
folder of JPEGs, the decoded pixels, not the JPEG files.
"""

from __future__ import annotations

import bz2
import io
import json
import lzma
import os
import time
import zlib

import numpy as np

from sparse_jax.data import images
from sparse_jax.data.sources import SPLITS
from sparse_jax.files import atomic_write

CODECS = {  # name -> (label, Pillow save options)
    "png": ("PNG (optimize)", dict(format="PNG", optimize=True)),
    "webp": ("WebP lossless (method 6)", dict(format="WEBP", lossless=True, quality=100,
                                              method=6)),
}


def compressed_size(pixels_HWC: np.ndarray, codec: str) -> tuple[int, bool]:
    """(bytes of one picture compressed by `codec`, whether it decodes to the same pixels)."""
    from PIL import Image

    mode = images.READ_MODE[pixels_HWC.shape[-1]]
    picture = Image.fromarray(pixels_HWC[..., 0] if mode == "L" else pixels_HWC, mode)
    buffer = io.BytesIO()
    picture.save(buffer, **CODECS[codec][1])
    decoded = Image.open(io.BytesIO(buffer.getvalue())).convert(mode)
    same = np.array_equal(np.asarray(decoded).reshape(pixels_HWC.shape), pixels_HWC)
    return buffer.tell(), same


def baselines(path: str, split: str = "test", split_fractions=(0.92, 0.04, 0.04),
              limit: int | None = None, codecs=tuple(CODECS), progress=None) -> dict:
    """Bits per dim of each codec over the pictures of `split` of the folder `path` (split as
    `images.load_folder` splits it; the default fractions are configs/images.py's). `limit`: N
    pictures spread evenly over the split (its first and last included) instead of all.
    `progress(done, total)` is called after each picture."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    unknown = sorted(set(codecs) - set(CODECS))
    if unknown:
        raise ValueError(f"unknown codec(s) {unknown}; known: {sorted(CODECS)}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive number of pictures, got {limit!r}")
    folder = images.load_folder(path, split_fractions)
    source = folder.splits[split]
    count = len(source) if limit is None else min(limit, len(source))
    if not count:
        raise ValueError(f"the {split} split of {folder.path} has 0 pictures ({folder.layout} "
                         f"split, split_fractions={tuple(split_fractions)}); choose another "
                         "--split or raise its share in --split_fractions")
    picked = np.round(np.linspace(0, len(source) - 1, count)).astype(np.int64)
    totals = {c: 0 for c in codecs}
    lossless = {c: True for c in codecs}
    start = time.time()
    for k, i in enumerate(picked):
        pixels = source.images([i]).reshape(folder.shape)
        for codec in codecs:
            size, same = compressed_size(pixels, codec)
            totals[codec] += size
            lossless[codec] &= same
        if progress is not None:
            progress(k + 1, count)
    subpixels = count * int(np.prod(folder.shape))
    return {"folder": folder.path, "split": split, "layout": folder.layout,
            "shape": list(folder.shape), "num_images": count, "split_size": len(source),
            "subpixels": subpixels, "seconds": time.time() - start,
            "codecs": {c: {"label": CODECS[c][0], "bytes": totals[c],
                           "bits_per_dim": 8 * totals[c] / subpixels, "lossless": lossless[c]}
                       for c in codecs}}


def format_table(result: dict) -> str:
    """Markdown table of a `baselines` result."""
    n, total = result["num_images"], result["split_size"]
    rows = [f"{result['split']} split of {result['folder']}: {n:,} of {total:,} pictures of "
            f"{' x '.join(map(str, result['shape']))}", "",
            "| codec | bytes | bytes/picture | bits/dim | lossless |", "|---|---|---|---|---|"]
    rows += [f"| {r['label']} | {r['bytes']:,} | {r['bytes'] / n:,.1f} | "
             f"{r['bits_per_dim']:.3f} | {'yes' if r['lossless'] else 'NO'} |"
             for r in result["codecs"].values()]
    return "\n".join(rows)


def default_output(path: str, split: str, limit: int | None = None) -> str:
    """Where the result goes by default: the folder's cache folder (`images.cache_dir`)."""
    return os.path.join(images.cache_dir(path), f"baselines_{split}"
                        + (f"_limit{limit}" if limit else "") + ".json")


def save(result: dict, path: str) -> None:
    """Writes `result` as JSON to `path` (whole or not at all); one-line OSError naming it."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with atomic_write(path) as f:
            json.dump(result, f, indent=1)
    except OSError as e:
        raise OSError(e.errno, f"could not write {path}: {e.strerror or e}; free some space or "
                               "choose another --output") from e


def last_repeat(data, k: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """For each position i of `data` (uint8 [n]): (distance int64 [n], copied bool [n]).
    distance[i] = i - j, where j is the position right after the last earlier
    occurrence of the k bytes before i (data[j - k:j] == data[i - k:i], j < i), 0 where they
    never occurred before (and for i < k); copied[i]: data[j] == data[i], the byte a copier
    that found that occurrence would predict. Sorting, not hashing: exact and O(n log n)."""
    data = np.ascontiguousarray(np.asarray(data, np.uint8))
    n = len(data)
    distance, copied = np.zeros(n, np.int64), np.zeros(n, bool)
    if n <= k:
        return distance, copied
    keys = np.lib.stride_tricks.sliding_window_view(data, k)[:n - k]  # row r: the k before r + k
    keys = np.ascontiguousarray(keys).view(np.dtype((np.void, k)))[:, 0]
    _, group = np.unique(keys, return_inverse=True)
    order = np.argsort(group.ravel(), kind="stable")  # by key, then by position
    same = group.ravel()[order[1:]] == group.ravel()[order[:-1]]
    later, earlier = order[1:][same] + k, order[:-1][same] + k  # positions i and j
    distance[later] = later - earlier
    copied[later] = data[earlier] == data[later]
    return distance, copied


def repeat_reach(data, distances, k: int = 12) -> dict[int, dict[str, float]]:
    """For each distance D (0: unlimited), the share of positions i >= k of `data` (uint8) whose
    k preceding bytes last occurred at most D bytes earlier ("seen": a copier with a context of
    D + k bytes finds them) and whose byte equals the byte after that occurrence ("copied": a
    copier would have predicted it). Byte strings compared exactly (`last_repeat`)."""
    distance, copied = last_repeat(data, k)
    total = max(len(distance) - k, 1)
    out = {}
    for d in distances:
        seen = (distance > 0) & (distance <= (d or len(distance)))
        out[d] = {"seen": int(seen.sum()) / total, "copied": int((seen & copied).sum()) / total}
    return out


def copy_classes(data, edges=(512, 4096), k: int = 12) -> np.ndarray:
    """The class of each position of `data` (int8 [n]) by how far back a copier finds its byte
    (`last_repeat`: the k bytes before it last occurred D back and the byte after them then
    equals it): class c for edges[c - 1] < D <= edges[c] (edges[-1] = 0), and len(edges) for
    the rest (copyable only from further back, or not by exact copy: k bytes never seen before,
    or a different byte after them). With the default edges: 0 = a 512-byte context can copy
    it, 1 = only a context of 513-4,096 bytes can, 2 = neither."""
    edges = list(edges)
    if not edges or any(b <= a for a, b in zip([0, *edges], edges)):
        raise ValueError(f"copy class edges must be positive and increasing, got {edges}")
    distance, copied = last_repeat(data, k)
    classes = np.full(len(distance), len(edges), np.int8)
    for c, (a, b) in reversed(list(enumerate(zip([0, *edges], edges)))):
        classes[copied & (distance > a) & (distance <= b)] = c
    return classes


def copy_class_names(edges=(512, 4096)) -> list[str]:
    """Labels of `copy_classes`' classes: "copy 1-512 back", ..., "rest"."""
    edges = list(edges)
    return [f"copy {a + 1:,}-{b:,} back" for a, b in zip([0, *edges], edges)] + [
        f"rest (no copy within {edges[-1]:,})"]


BYTE_CODECS = {  # name -> compress(bytes) -> bytes, as the command-line tools at these settings
    "gzip -9": lambda b: zlib.compress(b, 9),
    "bzip2 -9": lambda b: bz2.compress(b, 9),
    "xz -9e": lambda b: lzma.compress(b, preset=9 | lzma.PRESET_EXTREME),
}


def compressor_bits(before, part, codecs=tuple(BYTE_CODECS)) -> dict[str, float]:
    """Bits per byte each compressor pays for `part` given everything in `before` (both bytes or
    uint8 arrays): 8 x (size(c(before + part)) - size(c(before))) / len(part). A model scored on
    a test split has read the training text; so has a compressor run over the whole stream, and
    this is what it spends on the split's bytes. The codecs' own headers cancel. gzip's window
    is 32 KB and bzip2's block 900 KB, so they use little of `before`; xz uses it all."""
    before, part = (x if isinstance(x, bytes) else np.asarray(x, np.uint8).tobytes()
                    for x in (before, part))
    if not part:
        raise ValueError("compressor_bits: the part to pay for is empty")
    unknown = [c for c in codecs if c not in BYTE_CODECS]
    if unknown:
        raise ValueError(f"unknown compressors {unknown}; choose from {list(BYTE_CODECS)}")
    out = {}
    for name in codecs:
        compress = BYTE_CODECS[name]
        out[name] = 8 * (len(compress(before + part)) - len(compress(before))) / len(part)
    return out
