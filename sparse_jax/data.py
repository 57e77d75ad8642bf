"""Datasets: enwik8 and other byte files, CIFAR-10 through TFDS, and an embedded toy set.

Byte files are memory-mapped; a `.gz` file is decompressed once next to it. A file listed in
its folder's SHA256SUMS (as the corpus shipped in `data/` is) is checked against it before use,
once per version of the file. Everything here is NumPy on the host. Every batch is a dict of `[batch, seq_len]` arrays:

- `inputs` int32, `targets` int32: the model reads `inputs` and predicts `targets` position by
  position. Byte streams: a window starting at s has inputs x[s:s+L] and targets x[s+1:s+L+1].
  Images (3,072 sub-pixels, raster order row, column, channel): targets are the whole image and
  inputs are the image shifted right by one with the constant 0 in front, so all 3,072 dims are
  scored; since position 0 always reads 0, its output is an unconditional first-sub-pixel model.
- `mask` bool (evaluation batches only): which targets count. Summing -log2 p over `mask` and
  dividing by `mask.sum()` gives bits per byte / per dim.

Training iterators are pure functions of (seed, step, process): the batch at step k is drawn
from `np.random.default_rng([seed, k, process_index])` (byte windows) or read from the epoch
permutation `default_rng([seed, epoch])` (images). Their state is the JSON dict
`{"seed": int, "step": int}`, so a restored run sees exactly the batches it would have seen.
Each process draws its own `batch_size` rows; the global batch is batch_size x process_count.
"""

import dataclasses
import gzip
import hashlib
import json
import os
import shutil
import urllib.request
import zipfile
import zlib
from typing import Any, Iterator, NamedTuple

import numpy as np

ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
ENWIK8_SIZE = 100_000_000
ENWIK8_MD5 = "a1fa5ffddb56f4953e226637dabbb36a"  # of the raw (unzipped) 10^8 bytes
ENWIK8_FRACTIONS = (0.9, 0.05, 0.05)  # 90M train / 5M valid / 5M test (paper)
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
CIFAR10_VALID_SIZE = 2_000  # held out of TFDS `train` (paper: 48,000 / 2,000 / 10,000)
CIFAR10_SPLIT_SEED = 0  # fixed: the train/valid split never depends on the run's seed
DOWNLOAD_TIMEOUT_S = 10  # per socket operation; offline fails at once instead of retrying
SPLITS = ("train", "valid", "test")


def _download(url: str, dest: str, timeout: float = DOWNLOAD_TIMEOUT_S) -> None:
    """Fetches `url` to `dest` through a temporary file, so `dest` is either complete or absent."""
    tmp = f"{dest}.part{os.getpid()}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
            shutil.copyfileobj(response, f, 1 << 20)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---------------------------------------------------------------------------------------------
# Byte files.

CHECKSUMS = "SHA256SUMS"  # `sha256sum` format; a file listed in its folder's SHA256SUMS is checked
CORPUS = "data/kjv.html.gz"  # the corpus shipped with the repository (see data/README.md)


def _checksum(path: str) -> tuple[str, str] | None:
    """(expected sha256, the SHA256SUMS file) if `path`'s folder lists its name, else None."""
    listing = os.path.join(os.path.dirname(path) or ".", CHECKSUMS)
    try:
        with open(listing) as f:
            for line in f:
                digest, _, name = line.strip().partition("  ")
                if name.lstrip("*") == os.path.basename(path):
                    return digest.lower(), listing
    except OSError:
        pass
    return None


def _vouched(path: str, key: dict) -> bool:
    """Whether `<path>.verified` records `key` (a check that passed for this very file)."""
    try:
        with open(path + ".verified") as f:
            return json.load(f) == key
    except (OSError, ValueError):
        return False


def _vouch(path: str, key: dict) -> None:
    try:
        with open(path + ".verified", "w") as f:
            json.dump(key, f)
    except OSError:  # read-only folder: check again next time
        pass


def _file_key(path: str, **extra) -> dict:
    stat = os.stat(path)
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, **extra}


def _check_digest(path: str, algorithm: str, expected: str, fix: str) -> None:
    """Hashes `path` and compares with `expected` (ValueError that ends with `fix`); a passing
    result is recorded in `<path>.verified`, keyed by size and mtime, so each version of a file
    is hashed once."""
    key = _file_key(path, **{algorithm: expected})
    if _vouched(path, key):
        return
    with open(path, "rb") as f:
        got = hashlib.file_digest(f, algorithm).hexdigest()
    if got != expected:
        raise ValueError(f"{path} is damaged or not the expected file: {algorithm.upper()} "
                         f"{got[:12]}..., expected {expected[:12]}...; {fix}")
    _vouch(path, key)


def _check_listed(path: str) -> None:
    """Checks `path` against its folder's SHA256SUMS, if that lists it."""
    listed = _checksum(path)
    if listed is not None:
        _check_digest(path, "sha256", listed[0], f"{listed[1]} lists it; fetch it again (a file "
                      f"of this repository: git checkout -- {path})")


def _gunzip_cached(path: str) -> str:
    """The decompressed bytes of the .gz file `path`, written once to `path` without `.gz`
    (next to it) and checked against SHA256SUMS when listed there; returns that path.

    The copy is written through a temporary file and vouched for in `<copy>.verified`, keyed by
    the .gz file's size and mtime, so a later start maps it at once, and a changed .gz is
    decompressed again. A file at the copy's path that this function did not write is never
    replaced."""
    _check_listed(path)
    raw = path[:-3]
    source = _file_key(path)
    key = {"source_size": source["size"], "source_mtime_ns": source["mtime_ns"]}
    if os.path.exists(raw):
        if _vouched(raw, {**key, **_file_key(raw)}):
            return raw
        if not os.path.exists(raw + ".verified"):
            raise ValueError(f"{raw} exists but was not decompressed from {path} here; move it "
                             f"away, or set --config.data.path={raw} to read it instead")
    expected = _checksum(raw)
    tmp = f"{raw}.part{os.getpid()}"
    try:
        digest = hashlib.sha256()
        with gzip.open(path, "rb") as src, open(tmp, "wb") as out:
            while chunk := src.read(1 << 22):
                digest.update(chunk)
                out.write(chunk)
        if expected is not None and digest.hexdigest() != expected[0]:
            raise ValueError(f"{path} decompresses to bytes with sha256 {digest.hexdigest()[:12]}"
                             f"..., {expected[1]} expects {expected[0][:12]}... for {raw}; "
                             f"fetch {path} again (a file of this repository: git checkout -- "
                             f"{path})")
        # Vouched for before it appears, so another process never sees it unvouched (a rename
        # keeps the size and mtime the key records).
        _vouch(raw, {**key, **_file_key(tmp)})
        os.replace(tmp, raw)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ValueError(f"{path} is not a complete gzip file ({e}); fetch it again (a file of "
                         f"this repository: git checkout -- {path})") from e
    except OSError as e:
        raise OSError(e.errno, f"cannot write the decompressed copy of {path} next to it "
                               f"({e.strerror or e}); decompress it somewhere writable (gunzip "
                               "-k) and set --config.data.path to the copy") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return raw


def load_bytes(path: str) -> np.ndarray:
    """Any file as a read-only uint8 memory map; a `.gz` file is decompressed once next to it
    (`_gunzip_cached`). A file listed in its folder's SHA256SUMS is checked against it."""
    path = os.path.expanduser(os.fspath(path))
    if not os.path.exists(path):
        where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
        raise FileNotFoundError(f"data file {path} not found{where}: set --config.data.path to "
                                "an existing file, or run from the repository root")
    if os.path.isdir(path):
        raise IsADirectoryError(f"data path {path} is a folder; set --config.data.path to a file")
    if path.endswith(".gz"):
        path = _gunzip_cached(path)
    else:
        _check_listed(path)
    if os.path.getsize(path) == 0:
        raise ValueError(f"{path} is empty")
    return np.memmap(path, dtype=np.uint8, mode="r")


def split_bytes(data: np.ndarray, fractions=(0.9, 0.05, 0.05)) -> dict[str, np.ndarray]:
    """Contiguous train/valid/test slices (views) in this order; sizes round(cumsum(f) * n)."""
    if len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"split_fractions must be 3 non-negative numbers summing to 1, got "
                         f"{fractions}")
    cuts = [0, *(int(round(c * len(data))) for c in np.cumsum(fractions)[:2]), len(data)]
    return {name: data[a:b] for name, a, b in zip(SPLITS, cuts[:-1], cuts[1:])}


def _verify(path: str, size: int, md5: str) -> None:
    """Size and MD5 check of enwik8 (MD5 once per version of the file, see `_check_digest`)."""
    stat = os.stat(path)
    if stat.st_size != size:
        raise ValueError(f"{path} has {stat.st_size:,} bytes, expected {size:,}: wrong or "
                         f"truncated file; delete it and fetch {ENWIK8_URL} again")
    _check_digest(path, "md5", md5, f"delete it and fetch {ENWIK8_URL} again")


def _extract_member(zip_path: str, member: str, dest: str, size: int, md5: str) -> None:
    """Unzips `member` to `dest` via a checked temporary file; never replaces an existing file."""
    tmp = f"{dest}.part{os.getpid()}"
    try:
        with zipfile.ZipFile(zip_path) as z:
            if member not in z.namelist():
                raise ValueError(f"{zip_path} has no member {member!r} (has {z.namelist()[:5]})")
            digest, n = hashlib.md5(), 0
            with z.open(member) as src, open(tmp, "wb") as out:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    n += len(chunk)
                    out.write(chunk)
        if n != size or digest.hexdigest() != md5:
            raise ValueError(f"{zip_path}: member {member!r} has {n:,} bytes and MD5 "
                             f"{digest.hexdigest()}, expected {size:,} and {md5}; fetch "
                             f"{ENWIK8_URL} again")
        if os.path.exists(dest):
            raise FileExistsError(f"{dest} appeared while extracting; not replacing it")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_enwik8(path: str, *, download: bool = False, expected_size: int | None = None,
                expected_md5: str | None = None) -> np.ndarray:
    """The verified enwik8 bytes as a uint8 memory map.

    `path` names the raw file (`.../enwik8`) or the archive (`.../enwik8.zip`); each implies the
    other next to it. A raw file is used if present (it is never replaced). Otherwise the archive
    is unpacked once to the raw path, checked before it is renamed into place. With `download`,
    a missing archive is fetched from ENWIK8_URL first (fails fast when offline).
    Verification (size, MD5 of the raw bytes) is cached in `<raw>.verified`, keyed by size and
    mtime, so only the first start pays for hashing 100 MB. `expected_size`/`expected_md5`
    default to ENWIK8_SIZE/ENWIK8_MD5 (tests pass those of a tiny fake file).
    """
    size = ENWIK8_SIZE if expected_size is None else expected_size
    md5 = ENWIK8_MD5 if expected_md5 is None else expected_md5
    path = os.path.expanduser(os.fspath(path))
    raw, zip_path = (path[:-4], path) if path.endswith(".zip") else (path, path + ".zip")
    if not os.path.exists(raw):
        if not os.path.exists(zip_path):
            how = (f"Download {ENWIK8_URL} and put it at {zip_path} (it is unpacked to {raw} on "
                   f"first use), or set download=True when online.")
            if not download:
                raise FileNotFoundError(f"enwik8 not found at {raw} or {zip_path}. {how}")
            try:
                os.makedirs(os.path.dirname(zip_path) or ".", exist_ok=True)
                _download(ENWIK8_URL, zip_path)
            except OSError as e:
                raise FileNotFoundError(f"could not download {ENWIK8_URL} ({e}). {how}") from e
        _extract_member(zip_path, os.path.basename(raw), raw, size, md5)
    _verify(raw, size, md5)
    return load_bytes(raw)


class EvalWindows(NamedTuple):
    """Evaluation windows over a byte split of n bytes, with window length L.

    Window w has inputs data[s:s+L] and targets data[s+1:s+L+1] (s = starts[w], zero-padded past
    the end); it scores positions j with score_from[w] <= j < score_to[w]. Together the windows
    score every target data[t], 1 <= t < n, exactly once (data[0] is only context).
    """

    starts: np.ndarray  # int64 [W]
    score_from: np.ndarray  # int64 [W]
    score_to: np.ndarray  # int64 [W]; < L only in a final partial window


def eval_windows(data: np.ndarray, seq_len: int, min_context: int | None = None) -> EvalWindows:
    """Non-overlapping windows (min_context None or 0), or windows with stride seq_len - m that
    score only positions j >= m (so each scored byte sees m + 1 or more bytes before it), except
    the first window, which scores everything; the paper's Table 3 protocol."""
    m = min_context or 0
    if not 0 <= m < seq_len:
        raise ValueError(f"min_context must be in [0, seq_len={seq_len}), got {min_context}")
    num_targets, stride = len(data) - 1, seq_len - m
    count = 0 if num_targets <= 0 else 1 + max(0, -(-(num_targets - seq_len) // stride))
    starts = np.arange(count, dtype=np.int64) * stride
    score_from = np.where(starts == 0, 0, m).astype(np.int64)
    score_to = np.minimum(seq_len, num_targets - starts)
    return EvalWindows(starts, score_from, score_to)


def read_windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """Inputs data[s:s+L] and targets data[s+1:s+L+1] for each start, zero-padded past the end."""
    rows = np.zeros((len(starts), seq_len + 1), np.int32)
    for i, s in enumerate(starts):
        chunk = data[s:s + seq_len + 1]
        rows[i, :len(chunk)] = chunk
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


class _StepIterator:
    """An iterator whose batch at step k is `self.batch_at(k)`: its state is (seed, step)."""

    def __init__(self, seed: int, step: int = 0):
        self.seed, self.step = int(seed), int(step)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def get_state(self) -> dict[str, int]:
        return {"seed": self.seed, "step": self.step}

    def set_state(self, state: dict[str, int]) -> None:
        self.seed, self.step = int(state["seed"]), int(state["step"])


class ByteWindows(_StepIterator):
    """Training windows at uniformly random offsets of one contiguous (memory-mapped) array.

    Step k's global batch of batch_size x process_count windows is drawn from
    default_rng([seed, k]) and this process reads its slice, so the global batch does not
    depend on how many processes share it."""

    def __init__(self, data, seq_len, batch_size, seed=0, process_index=0, process_count=1):
        super().__init__(seed)
        if len(data) <= seq_len:
            raise ValueError(f"{len(data)} bytes cannot hold a window of {seq_len} + 1")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, {process_count})")
        self.data, self.seq_len, self.batch_size = data, seq_len, batch_size
        self.process_index, self.global_batch = process_index, batch_size * process_count

    def starts_at(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.data) - self.seq_len, size=self.global_batch)
        first = self.process_index * self.batch_size
        return starts[first:first + self.batch_size]

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        return read_windows(self.data, self.starts_at(step), self.seq_len)


# ---------------------------------------------------------------------------------------------
# CIFAR-10 through TFDS (imported lazily: byte datasets never pay for it).


def _cifar10_builder(data_dir):
    import tensorflow_datasets as tfds

    return tfds.builder("cifar10", data_dir=data_dir, file_format="array_record")


def prepare_cifar10(data_dir: str | None = None, manual_dir: str | None = None,
                    download: bool = False) -> str:
    """Prepares the real TFDS `cifar10` builder as array_record; returns the prepared folder.

    Offline it reads the official archive from `manual_dir` (default `<data_dir>/downloads/
    manual`), which TFDS checks against its recorded size and SHA-256. A missing archive fails at
    once with what to fetch and where to put it (or is fetched first, with `download`), instead of
    TFDS's minutes of download retries. Preparation needs TensorFlow; reading does not.
    """
    import tensorflow_datasets as tfds

    builder = _cifar10_builder(data_dir)
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
            _download(CIFAR10_URL, archive)
        except OSError as e:
            raise FileNotFoundError(f"could not download {CIFAR10_URL} ({e}). {how}") from e
    config = tfds.download.DownloadConfig(manual_dir=manual_dir, try_download_gcs=False)
    builder.download_and_prepare(download_config=config, file_format="array_record")
    return os.fspath(builder.data_dir)


def _check_array_record(builder) -> None:
    formats = {f.value for f in builder.info.available_file_formats()}
    if "array_record" not in formats:
        raise ValueError(f"CIFAR-10 in {builder.data_dir} is prepared as {sorted(formats)}, "
                         "not array_record, which random access needs: convert it (`tfds "
                         "convert_format`) or prepare it into another data_dir (prepare_cifar10)")


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
    import tensorflow_datasets as tfds

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    builder = _cifar10_builder(data_dir)
    if not builder.is_prepared():
        raise FileNotFoundError(f"CIFAR-10 is not prepared in {builder.data_dir}: run "
                                f"sparse_jax.data.prepare_cifar10(data_dir, manual_dir) once with "
                                f"{CIFAR10_URL.rsplit('/', 1)[1]} in the manual dir")
    _check_array_record(builder)
    tfds_split = "test" if split == "test" else "train"
    records = tfds.data_source("cifar10", split=tfds_split, data_dir=data_dir, download=False)
    if split == "test":
        return Cifar10Source(records, np.arange(len(records)))
    valid_size = CIFAR10_VALID_SIZE if valid_size is None else valid_size
    if not 0 < valid_size < len(records):
        raise ValueError(f"valid_size {valid_size} must be in (0, {len(records)})")
    perm = np.random.default_rng(CIFAR10_SPLIT_SEED).permutation(len(records))
    part = perm[:-valid_size] if split == "train" else perm[-valid_size:]
    return Cifar10Source(records, np.sort(part))


def _image_rows(images: np.ndarray) -> dict[str, np.ndarray]:
    targets = images.astype(np.int32)
    inputs = np.concatenate([np.zeros_like(targets[:, :1]), targets[:, :-1]], axis=1)
    return {"inputs": inputs, "targets": targets}


class ImageBatches(_StepIterator):
    """Epochs of shuffled images (each a permutation from default_rng([seed, epoch])), read in
    global batches of batch_size x process_count of which this process takes its slice; the
    last partial global batch of an epoch is dropped."""

    def __init__(self, source, batch_size, seed=0, process_index=0, process_count=1):
        super().__init__(seed)
        self.source, self.batch_size = source, batch_size
        self.process_index, self.global_batch = process_index, batch_size * process_count
        self.steps_per_epoch = len(source) // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"{len(source)} images are fewer than one global batch of "
                             f"{self.global_batch}")

    def indices_at(self, step: int) -> np.ndarray:
        epoch, i = divmod(step, self.steps_per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.source))
        first = i * self.global_batch + self.process_index * self.batch_size
        return perm[first:first + self.batch_size]

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        return _image_rows(self.source.images(self.indices_at(step)))


# ---------------------------------------------------------------------------------------------
# Embedded quickstart data.


def _embedded_params(row_width, copy_distance, copy_prob, alphabet_size, branching):
    if not (2 <= branching <= alphabet_size <= 94 and row_width >= 2 and copy_distance >= 1
            and 0 <= copy_prob < 1):
        raise ValueError("need 2 <= branching <= alphabet_size <= 94, row_width >= 2, "
                         "copy_distance >= 1 and 0 <= copy_prob < 1")


def embedded_bytes(num_bytes: int, seed: int = 0, *, row_width: int = 32, copy_distance: int = 4,
                   copy_prob: float = 0.75, alphabet_size: int = 16, branching: int = 8,
                   ) -> np.ndarray:
    """A byte stream of text rows with local and long-range structure, generated in-process.

    Rows are `row_width` bytes: `row_width - 1` symbols then a newline. Row r (r >= copy_distance)
    is, with probability `copy_prob`, an exact copy of row r - copy_distance, i.e. of the bytes
    exactly D = copy_distance * row_width positions back. Position i predicts byte i + 1, whose
    copy sits at i + 1 - D, so a strided pattern with stride D - 1 sees it directly (stride D
    needs the model to learn a relative offset; configs/quickstart.py); a model that cannot look
    that far back cannot predict the copies. Otherwise it
    is fresh: a Markov chain over `alphabet_size` printable characters whose first symbol is
    uniform and each next one uniform over `branching` successors of the previous. The successor
    table is doubly stochastic, so every symbol is equally frequent (unigram entropy about
    log2(alphabet_size) bits). Bits per byte: see `embedded_entropy_rate`. Deterministic in seed.
    """
    _embedded_params(row_width, copy_distance, copy_prob, alphabet_size, branching)
    rng = np.random.default_rng(seed)
    a, w, k = alphabet_size, row_width, copy_distance
    chars = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ0123456789"
                          b".,;:!?'-()[]{}<>/|@#$%^&*+=_~\\`\"", np.uint8)[:a]
    # succ[x, c] = perm[(x + shift[c]) % a]: distinct successors per x, a permutation per c.
    perm, shift = rng.permutation(a), rng.choice(a, size=branching, replace=False)
    succ = perm[(np.arange(a)[:, None] + shift[None, :]) % a]
    rows = -(-num_bytes // w)
    symbols = np.empty((rows, w - 1), np.uint8)
    symbols[:, 0] = rng.integers(0, a, size=rows, dtype=np.uint8)
    choices = rng.integers(0, branching, size=(rows, w - 2), dtype=np.uint8)
    for j in range(1, w - 1):
        symbols[:, j] = succ[symbols[:, j - 1], choices[:, j - 1]]
    fresh = (rng.random(rows) >= copy_prob) | (np.arange(rows) < k)
    # A copy row repeats the last fresh row at distance a multiple of k: a running max per residue.
    source = np.empty(rows, np.int64)
    for r in range(min(k, rows)):
        idx = np.arange(r, rows, k)
        source[idx] = np.maximum.accumulate(np.where(fresh[idx], idx, -1))
    text = np.concatenate([chars[symbols[source]], np.full((rows, 1), ord("\n"), np.uint8)], 1)
    return text.reshape(-1)[:num_bytes]


def embedded_entropy_rate(row_width: int = 32, copy_distance: int = 4, copy_prob: float = 0.75,
                          alphabet_size: int = 16, branching: int = 8, *,
                          sees_copies: bool = True) -> float:
    """Bits per byte of `embedded_bytes` in the long run (rows >= copy_distance).

    sees_copies=True: the best possible model, [H(copy_prob) + (1 - copy_prob) * H_row] / W, with
    H_row = log2(alphabet) + (W - 2) log2(branching) the entropy of a fresh row (exact up to the
    negligible chance that a fresh row equals its source). sees_copies=False: the floor of a model
    that cannot see copy_distance rows back, to which every row looks fresh: H_row / W.
    Defaults: 0.76 vs 2.94 bits/byte, with unigram entropy about 4.08 bits.
    """
    _embedded_params(row_width, copy_distance, copy_prob, alphabet_size, branching)
    h_row = np.log2(alphabet_size) + (row_width - 2) * np.log2(branching)
    if not sees_copies:
        return float(h_row / row_width)
    p = copy_prob
    h_flag = 0.0 if p == 0 else -(p * np.log2(p) + (1 - p) * np.log2(1 - p))
    return float((h_flag + (1 - p) * h_row) / row_width)


def unigram_entropy_bits(data: np.ndarray) -> float:
    """Entropy in bits of the byte frequencies of `data`."""
    p = np.bincount(np.asarray(data, np.uint8).reshape(-1), minlength=256) / data.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


# ---------------------------------------------------------------------------------------------
# The trainer's entry point.


def _field(config, name, default=None):
    """`config.name` for a dict, ConfigDict or any object; `default` when absent or None."""
    value = config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)
    return default if value is None else value


@dataclasses.dataclass
class Dataset:
    """Splits of one dataset plus their training and evaluation batches for one process."""

    name: str
    unit: str  # "byte" (bits per byte) or "dim" (bits per dim)
    seq_len: int
    splits: dict[str, Any]  # split name -> uint8 array (bytes) or Cifar10Source (images)
    seed: int = 0
    process_index: int = 0
    process_count: int = 1

    def train_batches(self, batch_size: int, state: dict | None = None) -> _StepIterator:
        """Endless per-process batches; `.get_state()` / `.set_state()` checkpoint the position."""
        args = (batch_size, self.seed, self.process_index, self.process_count)
        if self.unit == "dim":
            it = ImageBatches(self.splits["train"], *args)
        else:
            it = ByteWindows(self.splits["train"], self.seq_len, *args)
        if state is not None:
            it.set_state(state)
        return it

    def eval_batches(self, split: str, batch_size: int, min_context: int | None = None,
                     ) -> Iterator[dict[str, np.ndarray]]:
        """This process's share of one pass over `split`, with `mask` marking the scored targets.

        Windows (bytes) or images are dealt in global batches of batch_size x process_count, the
        last one padded with masked-out rows, so every process runs the same number of batches.
        """
        data = self.splits[split]
        if self.unit == "dim":
            count = len(data)
        else:
            windows = eval_windows(data, self.seq_len, min_context)
            count = len(windows.starts)
        global_batch = batch_size * self.process_count
        for first in range(0, count, global_batch):
            rows = first + self.process_index * batch_size + np.arange(batch_size)
            valid = rows < count
            rows = np.where(valid, rows, 0)
            if self.unit == "dim":
                batch = _image_rows(data.images(rows))
                batch["mask"] = np.broadcast_to(valid[:, None], batch["targets"].shape).copy()
            else:
                batch = read_windows(data, windows.starts[rows], self.seq_len)
                j = np.arange(self.seq_len)[None]
                batch["mask"] = (valid[:, None] & (j >= windows.score_from[rows, None])
                                 & (j < windows.score_to[rows, None]))
            yield batch


def make_dataset(config, seq_len: int, process_index: int = 0, process_count: int = 1) -> Dataset:
    """The dataset named by `config.name`: "enwik8", "bytes", "cifar10" or "embedded".

    Fields read (dict, ConfigDict or object): name; path (enwik8 raw/zip or any byte file,
    plain or .gz);
    download (enwik8 only, default False); data_dir and manual_dir (TFDS); split_fractions
    (bytes, embedded; default 0.9/0.05/0.05); embedded_bytes and embedded_seed (embedded;
    defaults 2**21 and 0); seed (training order; default 0).
    """
    name = _field(config, "name")
    fractions = tuple(_field(config, "split_fractions", (0.9, 0.05, 0.05)))
    if name == "cifar10":
        if seq_len != 3072:
            raise ValueError(f"CIFAR-10 images are 3072 bytes long, got seq_len {seq_len}")
        data_dir = _field(config, "data_dir")
        splits, unit = {s: cifar10_source(s, data_dir) for s in SPLITS}, "dim"
    elif name == "enwik8":
        data = load_enwik8(_field(config, "path"), download=bool(_field(config, "download", False)))
        splits, unit = split_bytes(data, ENWIK8_FRACTIONS), "byte"
    elif name == "bytes":
        splits, unit = split_bytes(load_bytes(_field(config, "path")), fractions), "byte"
    elif name == "embedded":
        data = embedded_bytes(int(_field(config, "embedded_bytes", 2**21)),
                              int(_field(config, "embedded_seed", 0)))
        splits, unit = split_bytes(data, fractions), "byte"
    else:
        raise ValueError(f"unknown dataset {name!r}: use enwik8, bytes, cifar10 or embedded")
    return Dataset(name, unit, seq_len, splits, int(_field(config, "seed", 0)), process_index,
                   process_count)
