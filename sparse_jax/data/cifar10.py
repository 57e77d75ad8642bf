"""CIFAR-10 through TFDS: the real builder prepared as array_record (offline: from the official
binary archive in its manual dir, checked by size and checksum) and read without TensorFlow.
TFDS is an optional extra (`pip install 'sparse_jax[tfds]'`), imported only here and only when
CIFAR-10 is used (`tfds()`: a one-line error saying how to install it), so byte data and picture
folders never need TensorFlow. Facts about the format: docs/design.md §6.
"""

import os

import numpy as np

from sparse_jax.data.sources import SPLITS, fetch_url

# ---------------------------------------------------------------------------------------------
# CIFAR-10 through TFDS: an optional extra (`pip install 'sparse_jax[tfds]'`), imported only here
# and only when CIFAR-10 is used, so byte data and image folders never need TensorFlow.

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
CIFAR10_VALID_SIZE = 2_000  # held out of TFDS `train` (paper: 48,000 / 2,000 / 10,000)
CIFAR10_SPLIT_SEED = 0  # fixed: the train/valid split never depends on the run's seed
TFDS_EXTRA = "pip install 'sparse_jax[tfds]'"


def tfds():
    """The `tensorflow_datasets` module, or a one-line ModuleNotFoundError saying how to install
    it (the default install has no TensorFlow)."""
    try:
        import tensorflow_datasets
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"CIFAR-10 through TFDS needs tensorflow-datasets, which is not installed ({e}): "
            f"{TFDS_EXTRA} (or pip install -r requirements.txt), or train on a folder of "
            "pictures instead (configs/images.py)", name="tensorflow_datasets") from e
    return tensorflow_datasets


def _cifar10_builder(data_dir):
    return tfds().builder("cifar10", data_dir=data_dir, file_format="array_record")


def _check_array_record(builder) -> None:
    formats = {f.value for f in builder.info.available_file_formats()}
    if "array_record" not in formats:
        raise ValueError(f"CIFAR-10 in {builder.data_dir} is prepared as {sorted(formats)}, "
                         "not array_record, which random access needs: convert it (`tfds "
                         "convert_format`) or prepare it into another data_dir (prepare_cifar10)")


def prepare_cifar10(data_dir: str | None = None, manual_dir: str | None = None,
                    download: bool = False) -> str:
    """Prepares the real TFDS `cifar10` builder as array_record; returns the prepared folder.

    Offline it reads the official archive from `manual_dir` (default `<data_dir>/downloads/
    manual`), which TFDS checks against its recorded size and SHA-256. A missing archive fails at
    once with what to fetch and where to put it (or is fetched first, with `download`), instead of
    TFDS's minutes of download retries; one of the wrong size or SHA-256 fails in one line too.
    Preparation needs TensorFlow; reading does not.
    """
    builder = _cifar10_builder(data_dir)  # a missing TFDS fails here, in one line
    from tensorflow_datasets.core.download.download_manager import NonMatchingChecksumError

    if builder.is_prepared():
        _check_array_record(builder)
        return os.fspath(builder.data_dir)
    manual_dir = os.fspath(manual_dir or os.path.join(builder.data_dir_root, "downloads", "manual"))
    archive = os.path.join(manual_dir, builder.url_infos[CIFAR10_URL].filename)
    if not os.path.exists(archive):
        how = f"Download {CIFAR10_URL} and put it in {manual_dir}/ (expected file: {archive})."
        if not download:
            raise FileNotFoundError(f"CIFAR-10 archive not found. {how}")
        try:
            os.makedirs(manual_dir, exist_ok=True)
            fetch_url(CIFAR10_URL, archive)
        except OSError as e:
            raise FileNotFoundError(f"could not download {CIFAR10_URL} ({e}). {how}") from e
    if os.path.isdir(archive):
        raise IsADirectoryError(f"CIFAR-10 archive {archive} is a folder; put the file "
                                f"{CIFAR10_URL} there instead")
    expected = builder.url_infos[CIFAR10_URL].size
    if os.path.getsize(archive) != expected:
        raise ValueError(f"CIFAR-10 archive {archive} has {os.path.getsize(archive):,} bytes, "
                         f"expected {expected:,}: truncated or not the official file; download "
                         f"{CIFAR10_URL} again")
    config = tfds().download.DownloadConfig(manual_dir=manual_dir, try_download_gcs=False)
    try:
        builder.download_and_prepare(download_config=config, file_format="array_record")
    except NonMatchingChecksumError as e:  # TFDS's message spans lines: the one fact it states
        raise ValueError(f"CIFAR-10 archive {archive} is not the official file (its SHA-256 "
                         f"differs from the one TFDS records); download {CIFAR10_URL} "
                         "again") from e
    except OSError as e:
        raise OSError(e.errno, f"cannot prepare CIFAR-10 from {archive} into "
                               f"{builder.data_dir_root} ({e.strerror or e}); free space or set "
                               "--config.data.data_dir to a writable folder") from e
    return os.fspath(builder.data_dir)


class Cifar10Source:
    """Random access to one CIFAR-10 split; images as uint8 [3072] in raster order (row, column,
    channel)."""

    def __init__(self, records, indices: np.ndarray):
        self.records, self.indices = records, indices  # TFDS data source, rows of it in this split

    def __len__(self) -> int:
        return len(self.indices)

    def examples(self, idx) -> list[dict]:
        return self.records.__getitems__([int(self.indices[i]) for i in idx])

    def images(self, idx) -> np.ndarray:
        """uint8 [len(idx), 3072]."""
        return np.stack([np.asarray(e["image"], np.uint8).reshape(-1) for e in self.examples(idx)])


def cifar10_source(split: str, data_dir: str | None = None, valid_size: int | None = None,
                   ) -> Cifar10Source:
    """Prepared CIFAR-10 split "train" (TFDS train minus `valid_size`), "valid" or "test".

    The valid images are the last `valid_size` of a permutation of TFDS `train` drawn with the
    fixed CIFAR10_SPLIT_SEED; both index sets are kept in TFDS's stored order. `valid_size`
    defaults to CIFAR10_VALID_SIZE.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    builder = _cifar10_builder(data_dir)
    if not builder.is_prepared():
        raise FileNotFoundError(f"CIFAR-10 is not prepared in {builder.data_dir}: run "
                                f"data.cifar10.prepare_cifar10(data_dir, manual_dir) once "
                                f"with {CIFAR10_URL.rsplit('/', 1)[1]} in the manual dir")
    _check_array_record(builder)
    tfds_split = "test" if split == "test" else "train"
    records = tfds().data_source("cifar10", split=tfds_split, data_dir=data_dir, download=False)
    if split == "test":
        return Cifar10Source(records, np.arange(len(records)))
    valid_size = CIFAR10_VALID_SIZE if valid_size is None else valid_size
    if not 0 < valid_size < len(records):
        raise ValueError(f"valid_size {valid_size} must be in (0, {len(records)})")
    perm = np.random.default_rng(CIFAR10_SPLIT_SEED).permutation(len(records))
    part = perm[:-valid_size] if split == "train" else perm[-valid_size:]
    return Cifar10Source(records, np.sort(part))


def cifar10_fingerprint(data_dir: str | None = None) -> dict:
    """What identifies the prepared CIFAR-10 in `data_dir`: the TFDS version and split sizes,
    and the fixed train/valid split (`cifar10_source`); reads TFDS metadata, not images."""
    builder = _cifar10_builder(data_dir)
    splits = builder.info.splits
    return {"name": "cifar10", "tfds_version": str(builder.version),
            "num_examples": {s: int(splits[s].num_examples) for s in ("train", "test")},
            "valid_size": CIFAR10_VALID_SIZE, "split_seed": CIFAR10_SPLIT_SEED}
