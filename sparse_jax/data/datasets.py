"""The data config, the byte and image datasets, and their batch iterators.

`data_config(config.data)` turns the config section into a frozen, validated `DataConfig`;
`make_dataset` reads its splits (through `data.sources` and `sparse_jax.data.images`) into a
`ByteDataset` (enwik8, any byte file, the generated "embedded" stream; bits per byte) or an
`ImageDataset` (CIFAR-10, or any folder of same-size pictures; bits per dim).
`DataConfig.is_image` is the one answer to "is this an image model". Everything here is NumPy on
the host. Data that cannot serve a run (a missing or damaged file, a split too small for its
use, a token outside the vocabulary) fails in `prepare` / `make_dataset`, before anything is
compiled, with a one-line error naming the file and the fix; `fingerprint` / `check_fingerprint`
detect a data file that changed since a run started. Every batch is a dict of `[batch, seq_len]`
arrays:

- `inputs` int32, `targets` int32: the model reads `inputs` and predicts `targets` position by
  position. Byte streams: a window starting at s has inputs x[s:s+L] and targets x[s+1:s+L+1].
  Images (H x W x C sub-pixels, e.g. CIFAR-10's 3,072, raster order row, column, channel):
  targets are the whole image and inputs are the image shifted right by one with the constant 0
  in front, so every dim is scored; since position 0 always reads 0, its output is an
  unconditional first-sub-pixel model.
- `mask` bool (evaluation batches only): which targets count. Summing -log2 p over `mask` and
  dividing by `mask.sum()` gives bits per byte / per dim.

Training iterators are pure functions of (seed, step): step k's global batch of batch_size x
process_count rows is the same for any number of processes, and process p reads rows
[p * batch_size, (p + 1) * batch_size) of it. Byte windows start at offsets drawn from
`np.random.default_rng([seed, k])`; images are read in the order of the epoch's permutation
`default_rng([seed, epoch])`. An iterator's state is the JSON dict `{"seed": int, "step": int}`
(`get_state` / `set_state`, saved in checkpoints), so a restored run sees exactly the batches it
would have seen.
"""

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, Iterator

import numpy as np

from sparse_jax.data import images, sources
from sparse_jax.data.batches import (
    ByteWindows,
    ImageBatches,
    Stage,
    StagedBatches,
    StepIterator,
    eval_windows,
    image_rows,
    read_windows,
    split_bytes,
)
from sparse_jax.data.cifar10 import cifar10_fingerprint, cifar10_source, prepare_cifar10
from sparse_jax.data.sources import SPLITS

DATASETS = ("enwik8", "bytes", "cifar10", "images", "embedded")
IMAGE_DATASETS = ("cifar10", "images")  # bits per dim; "images": a folder of pictures
IMAGE_SHAPES = {"cifar10": (32, 32, 3)}  # (rows, columns, channels) where the dataset fixes it


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The `config.data` section; validated on construction (one-line ValueError per field)."""
    name: str  # enwik8 | bytes | cifar10 | images | embedded
    # enwik8: raw file or .zip; bytes: any file (a .gz is decompressed); images: a folder
    path: str | None = None
    download: bool = False  # enwik8, cifar10: fetch a missing archive (needs network)
    data_dir: str | None = None  # cifar10: TFDS data dir (None: TFDS default)
    manual_dir: str | None = None  # cifar10: the archive's folder (None: data_dir/downloads/manual)
    split_fractions: tuple[float, float, float] = (0.9, 0.05, 0.05)  # bytes, embedded, images
    seed: int = 0  # training order (window offsets / epoch permutations)
    embedded_bytes: int = 2**21  # size of the generated "embedded" stream
    embedded_seed: int = 0  # generator seed of the "embedded" stream
    embedded_row_width: int = 32  # bytes per row of the "embedded" stream (newline included)
    embedded_copy_distance: int = 4  # rows back that a copied row repeats: D = this x row width

    def __post_init__(self):
        def fail(field, why):
            raise ValueError(f"DataConfig.{field}={getattr(self, field)!r}: {why}")

        if self.name not in DATASETS:
            fail("name", f"unknown dataset: use one of {list(DATASETS)}")
        for name in ("path", "data_dir", "manual_dir"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                    fail(name, "must be None or a path (not empty)")
                object.__setattr__(self, name, os.fspath(value))
        if self.name in ("enwik8", "bytes", "images") and not self.path:
            what = "a folder of pictures: set --config.data.path=FOLDER" if self.name == \
                "images" else "a file: set --config.data.path=FILE"
            fail("path", f"data {self.name!r} needs {what}")
        if not isinstance(self.download, bool):
            fail("download", "must be True or False")
        for name, low in (("seed", 0), ("embedded_bytes", 1), ("embedded_seed", 0),
                          ("embedded_row_width", 2), ("embedded_copy_distance", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                fail(name, f"must be an integer >= {low}")
        if self.embedded_row_width > self.embedded_bytes:  # one row, generated column by column
            fail("embedded_row_width", f"must be at most embedded_bytes={self.embedded_bytes:,} "
                                       "(a row longer than the stream)")
        fractions = self.split_fractions
        if isinstance(fractions, (list, tuple)):
            object.__setattr__(self, "split_fractions", tuple(fractions))
        if not (isinstance(fractions, (list, tuple)) and len(fractions) == 3
                and all(isinstance(f, (int, float)) and not isinstance(f, bool) for f in fractions)
                and min(fractions) >= 0 and abs(sum(fractions) - 1) <= 1e-6):
            fail("split_fractions", "must be 3 non-negative numbers (train, valid, test) summing "
                                    "to 1")

    @property
    def is_image(self) -> bool:
        """Whether examples are images (bits per dim), not windows of a byte stream."""
        return self.name in IMAGE_DATASETS

    @property
    def image_shape(self) -> tuple[int, int, int] | None:
        """(rows, columns, channels) where the dataset fixes it (CIFAR-10); None for byte data
        and image folders, whose pictures say (`ImageDataset.image_shape`)."""
        return IMAGE_SHAPES.get(self.name)

    @property
    def unit(self) -> str:
        """What bits are counted per: "dim" (a sub-pixel of an image) or "byte"."""
        return "dim" if self.is_image else "byte"

    @property
    def fractions(self) -> tuple[float, float, float]:
        """The train/valid/test fractions of a byte stream (enwik8: the paper's 90M/5M/5M)."""
        return sources.ENWIK8_FRACTIONS if self.name == "enwik8" else self.split_fractions


def data_config(config) -> DataConfig:
    """`DataConfig` from a ConfigDict (`config.data`), a mapping or a DataConfig; unknown or
    missing fields raise ValueError."""
    if isinstance(config, DataConfig):
        return config
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ValueError(f"expected a ConfigDict or mapping, got {type(config).__name__}")
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(f"unknown data config field(s) {unknown}; valid: {sorted(fields)}")
    if "name" not in config:
        raise ValueError(f"missing data config field 'name' (one of {', '.join(DATASETS)})")
    return DataConfig(**config)


# ---------------------------------------------------------------------------------------------
# Datasets.

_Reader = Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]  # (rows, valid) -> batch


@dataclasses.dataclass
class Dataset:
    """Splits of one dataset plus their training and evaluation batches for one process.

    Subclasses say how a split is read: `ByteDataset` (windows of a byte stream) and
    `ImageDataset` (whole images)."""

    name: str
    seq_len: int
    # split name -> uint8 array (bytes), or Cifar10Source / images.ImageSplit (images)
    splits: dict[str, Any]
    seed: int = 0
    process_index: int = 0
    process_count: int = 1
    source: str = "the data"  # what errors name: the file, the generated stream, the TFDS folder
    fractions: tuple[float, ...] | None = None  # bytes: the stream's train/valid/test fractions
    image_shape: tuple[int, int, int] | None = None  # images: (rows, columns, channels)
    # image folders: the `images.Folder` read (for its fingerprint)
    folder: Any = dataclasses.field(default=None, repr=False)
    unit: ClassVar[str]  # "byte" (bits per byte) or "dim" (bits per dim)
    items: ClassVar[str]  # what a split holds: "bytes" or "images"
    min_eval: ClassVar[int]  # the fewest items of a split that can be scored

    def train_batches(self, batch_size: int, state: dict | None = None,
                      stages: tuple[Stage, ...] = ()) -> StepIterator:
        """Endless per-process batches; `.get_state()` / `.set_state()` checkpoint the position.

        `stages`: the training run's context stages (`Stage`: until, seq_len, batch_size) with
        per-process batch sizes: steps before `until` read windows of `seq_len` (byte streams
        only), the rest full windows of `batch_size`."""
        it = self._train_iterator(batch_size)
        if stages:
            if self.items != "bytes":
                raise ValueError(f"context stages need a byte stream; {self.source} holds "
                                 f"{self.items}: set --config.context_stages=()")
            it = StagedBatches([(stage.until, ByteWindows(
                self.splits["train"], stage.seq_len, stage.batch_size, self.seed,
                self.process_index, self.process_count)) for stage in map(Stage._make, stages)],
                it)
        if state is not None:
            it.set_state(state)
        return it

    def num_sequences(self, split: str, min_context: int | None = None) -> int:
        """Rows (windows or images) of one evaluation pass over `split`, padding excluded."""
        return self._eval_reader(split, min_context)[0]

    def eval_batches(self, split: str, batch_size: int, min_context: int | None = None,
                     ) -> Iterator[dict[str, np.ndarray]]:
        """This process's share of one pass over `split`, with `mask` marking the scored targets.

        Windows (bytes) or images are dealt in global batches of batch_size x process_count, the
        last one padded with masked-out rows, so every process runs the same number of batches.
        """
        count, read = self._eval_reader(split, min_context)
        global_batch = batch_size * self.process_count
        for first in range(0, count, global_batch):
            rows = first + self.process_index * batch_size + np.arange(batch_size)
            valid = rows < count
            yield read(np.where(valid, rows, 0), valid)

    def require(self, split: str, need: int, purpose: str, fix: str = "",
                instead: str | None = None) -> None:
        """A one-line ValueError naming the data, the split, its size, `need` and what to do
        (`_FIXES`, then `fix`; or `instead`, where the config cannot change, as in evaluation)
        unless `split` holds at least `need` items (bytes or images)."""
        have = len(self.splits[split])
        if have < need:
            todo = _FIXES.get(self.name, "") + fix if instead is None else instead
            raise ValueError(f"{self.source}: {self._describe(split)} has {have:,} {self.items}; "
                             f"{purpose} needs at least {need:,}; {todo}")

    def check_split(self, split: str, min_context: int | None = None,
                    instead: str | None = None) -> int:
        """`num_sequences(split, min_context)`, or a one-line ValueError (`require`, with
        `instead` as its fix if given) if the split has nothing to score."""
        self.require(split, self.min_eval, f"scoring the {split} split", instead=instead)
        return self.num_sequences(split, min_context)

    def scorable(self, but: str) -> list[str]:
        """The splits other than `but` that hold something to score, as "--split=NAME (N bytes)"
        for an error's fix."""
        return [f"--split={s} ({len(self.splits[s]):,} {self.items})" for s in SPLITS
                if s != but and len(self.splits[s]) >= self.min_eval]

    def _describe(self, split: str) -> str:
        return f"the {split} split"

    def _train_iterator(self, batch_size: int) -> StepIterator:
        raise NotImplementedError

    def _eval_reader(self, split: str, min_context: int | None) -> tuple[int, _Reader]:
        """(rows in one pass over `split`, the function that reads rows as a masked batch)."""
        raise NotImplementedError


class ByteDataset(Dataset):
    """Splits of one byte stream: random training windows, evaluation windows (`eval_windows`)."""

    unit, items, min_eval = "byte", "bytes", 2  # one byte of context and one to score

    def _describe(self, split):
        if self.fractions is None:
            return f"the {split} split"
        i, total = SPLITS.index(split), sum(len(x) for x in self.splits.values())
        field = "split_fractions" if self.name != "enwik8" else "fractions"
        return f"the {split} split ({field}[{i}]={self.fractions[i]:g} of {total:,} bytes)"

    def _train_iterator(self, batch_size):
        return ByteWindows(self.splits["train"], self.seq_len, batch_size, self.seed,
                           self.process_index, self.process_count)

    def _eval_reader(self, split, min_context):
        data = self.splits[split]
        windows = eval_windows(data, self.seq_len, min_context)
        j = np.arange(self.seq_len)[None]

        def read(rows, valid):
            batch = read_windows(data, windows.starts[rows], self.seq_len)
            batch["mask"] = (valid[:, None] & (j >= windows.score_from[rows, None])
                             & (j < windows.score_to[rows, None]))
            return batch

        return len(windows.starts), read


class ImageDataset(Dataset):
    """Splits of images: shuffled training epochs, every sub-pixel of every image scored."""

    unit, items, min_eval = "dim", "images", 1

    def _train_iterator(self, batch_size):
        need = batch_size * self.process_count
        self.require("train", need, f"a global batch of {batch_size} x {self.process_count} "
                     "processes", ", or lower --config.batch_size")
        return ImageBatches(self.splits["train"], batch_size, self.seed, self.process_index,
                            self.process_count)

    def _eval_reader(self, split, min_context):
        if min_context is not None:
            raise ValueError("min_context applies to byte data only")
        source = self.splits[split]

        def read(rows, valid):
            batch = image_rows(source.images(rows))
            batch["mask"] = np.broadcast_to(valid[:, None], batch["targets"].shape).copy()
            return batch

        return len(source), read


def prepare(config) -> None:
    """Prepares what `make_dataset` reads and that must exist first: the TFDS CIFAR-10 builder
    (fails at once if its archive is missing, unless `download`). Byte data needs nothing."""
    cfg = data_config(config)
    if cfg.name == "cifar10":
        prepare_cifar10(cfg.data_dir, cfg.manual_dir, cfg.download)


_FIXES = {  # what to do about a split too small for its use
    "enwik8": "use the complete enwik8",
    "bytes": "raise its share in --config.data.split_fractions or use a larger file",
    "embedded": "raise --config.data.embedded_bytes or its share in --config.data.split_fractions",
    "cifar10": "prepare the complete CIFAR-10 (prepare_cifar10)",
    "images": "add pictures to the folder, or raise the split's share in "
              "--config.data.split_fractions"}


def _byte_source(cfg: DataConfig, path_flag: str = "--config.data.path",
                 ) -> tuple[str, np.ndarray]:
    """(what errors name: the file or the generated stream, its bytes) of byte data `cfg`;
    `path_flag`: the option that named a byte file (`sources.load_bytes`)."""
    if cfg.name == "enwik8":
        return cfg.path, sources.load_enwik8(cfg.path, download=cfg.download)
    if cfg.name == "bytes":
        return cfg.path, sources.load_bytes(cfg.path, path_flag)
    return (f"the generated 'embedded' stream ({cfg.embedded_bytes:,} bytes)",
            sources.embedded_bytes(cfg.embedded_bytes, cfg.embedded_seed,
                                   row_width=cfg.embedded_row_width,
                                   copy_distance=cfg.embedded_copy_distance))


def make_dataset(config, seq_len: int, process_index: int = 0, process_count: int = 1, *,
                 vocab_size: int | None = None,
                 image_shape: tuple[int, int, int] | None = None, training: bool = True,
                 path_flag: str = "--config.data.path") -> Dataset:
    """The dataset of `config` (a DataConfig, or a ConfigDict / mapping for `data_config`).

    enwik8: `path` names the raw file or the .zip (`download` fetches a missing archive), split
    90M/5M/5M. bytes: any file at `path` (plain or .gz), split by `split_fractions`. embedded:
    `embedded_bytes` bytes generated with `embedded_seed` (rows of `embedded_row_width` bytes,
    copies `embedded_copy_distance` rows back: `sources.embedded_bytes`), split by
    `split_fractions`. cifar10:
    the prepared TFDS builder in `data_dir` (see `prepare`). images: the pictures of the folder
    `path` (`images.load_folder`; train/ and test/ subfolders, or `split_fractions`). An image's
    sub-pixels must number seq_len, and with `image_shape` (the model's) its shape must be that;
    a folder's pictures are checked before they are decoded.

    Before anything is compiled, it refuses (one-line errors naming the file and the split)
    data that cannot serve a run: a byte train split shorter than one window (seq_len + 1
    bytes), a valid split with nothing to score (< 2 bytes), an empty image split, and with
    `vocab_size`, data with a token >= vocab_size (`check_vocabulary`). The test split is
    checked when it is scored (`Dataset.check_split`). `training=False` (data that is only
    scored or measured: evaluation, scripts/repeats.py) checks none of the splits: its user
    checks the one it reads. `path_flag`: the option that named a byte file (scripts/evaluate.py:
    --data), which its errors tell the user to set.
    """
    cfg = data_config(config)
    kwargs = dict(seed=cfg.seed, process_index=process_index, process_count=process_count)
    if cfg.name == "images":
        what = f"the pictures in {cfg.path}"
        folder = images.load_folder(cfg.path, cfg.split_fractions, lambda shape: (
            images.check_model_shape(what, shape, seq_len, image_shape)))
        ds = ImageDataset(cfg.name, seq_len, folder.splits, **kwargs, source=what,
                          image_shape=folder.shape, folder=folder)
    elif cfg.is_image:
        images.check_model_shape("CIFAR-10 images", cfg.image_shape, seq_len, image_shape)
        splits = {s: cifar10_source(s, cfg.data_dir) for s in SPLITS}
        where = cfg.data_dir or "the TFDS default data dir"
        ds = ImageDataset(cfg.name, seq_len, splits, **kwargs, source=f"CIFAR-10 in {where}",
                          image_shape=cfg.image_shape)
    if cfg.is_image:
        for split in SPLITS if training else ():
            ds.require(split, 1, "training" if split == "train" else "evaluation")
    else:
        source, data = _byte_source(cfg, path_flag)
        ds = ByteDataset(cfg.name, seq_len, split_bytes(data, cfg.fractions), **kwargs,
                         source=source, fractions=cfg.fractions)
        if training:
            ds.require("train", seq_len + 1, "training (one window of seq_len + 1 bytes)",
                       ", or lower --config.model.seq_len")
            ds.require("valid", ds.min_eval, "validation")
    if vocab_size is not None:
        check_vocabulary(ds, vocab_size)
    return ds


def check_vocabulary(dataset: Dataset, vocab_size: int) -> None:
    """A one-line ValueError naming the data, the offending value and its offset if a token of
    `dataset` is >= `vocab_size`. Bytes and sub-pixels are 0..255, so vocab_size >= 256 passes
    without reading anything; a smaller one scans each byte split once (np.max over the memory
    map: a few hundredths of a second per 100 MB in the page cache); images need 256."""
    if vocab_size >= 256:
        return
    fix = "set --config.model.vocab_size=256 (covers every byte)"
    if dataset.unit == "dim":
        raise ValueError(f"{dataset.source}: sub-pixels take values 0..255, outside "
                         f"model.vocab_size={vocab_size}; {fix}")
    offset = 0
    for split in SPLITS:
        data = dataset.splits[split]
        if len(data) and (top := int(np.max(data))) >= vocab_size:
            at = int(np.argmax(np.asarray(data) >= vocab_size))
            raise ValueError(f"{dataset.source}: byte value {int(data[at])} at offset "
                             f"{offset + at:,} ({split} split; largest {top}) is outside "
                             f"model.vocab_size={vocab_size}; {fix}")
        offset += len(data)


# ---------------------------------------------------------------------------------------------
# The data a run started with.


def fingerprint(config, dataset: Dataset | None = None) -> dict:
    """What identifies the data of `config`: record it when a run starts, compare on resume
    (`check_fingerprint`). Byte data: {"name", "path", "size", "sha256"} of the whole stream the
    model reads (of a .gz file: the decompressed bytes), hashed in full (~0.06 s per 100 MB);
    `dataset` (from `make_dataset`) spares loading it again. enwik8: the size and MD5 that
    `load_enwik8` verifies, not hashed again. cifar10: `cifar10_fingerprint`. images:
    `images.fingerprint` (the pixels of every split, hashed in full, and how they were split)."""
    cfg = data_config(config)
    if cfg.name == "images":
        return images.fingerprint(dataset.folder if dataset is not None else
                                  images.load_folder(cfg.path, cfg.split_fractions))
    if cfg.is_image:
        return cifar10_fingerprint(cfg.data_dir)
    if cfg.name == "enwik8":
        if dataset is None:
            sources.load_enwik8(cfg.path, download=cfg.download)  # verifies size and MD5
        return {"name": "enwik8", "path": cfg.path, "size": sources.ENWIK8_SIZE,
                "md5": sources.ENWIK8_MD5}
    parts = [dataset.splits[s] for s in SPLITS] if dataset is not None else [_byte_source(cfg)[1]]
    return sources.stream_fingerprint(cfg.name, cfg.path, parts)


def check_fingerprint(recorded: dict | None, config, dataset: Dataset | None = None) -> dict:
    """The current `fingerprint(config, dataset)`, after a one-line ValueError naming the data
    and the first field that differs from `recorded` ("path" is not compared: a moved file is
    the same data). `recorded` None checks nothing."""
    current, cfg = fingerprint(config, dataset), data_config(config)
    what = {"embedded": "the generated 'embedded' stream", "cifar10": "CIFAR-10 in "
            f"{cfg.data_dir or 'the TFDS default data dir'}",
            "images": f"the pictures in {cfg.path}"}.get(cfg.name, cfg.path)
    if recorded is not None:
        sources.check_unchanged(recorded, current, what)
    return current
