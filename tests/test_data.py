"""Data loading on small files written here in the real formats (enwik8.zip, CIFAR-10 binary)."""

import errno
import gzip
import hashlib
import json
import os
import socket
from unittest import mock

import ml_collections
import numpy as np
import pytest

from conftest import (
    NUM_TEST,
    TRAIN_PER_FILE,
    corrupt_middle,
    fake_enwik8,
    files_in,
    gz_with_sums,
    one_line_error,
)
from sparse_jax import files
from sparse_jax.data import cifar10, sources
from sparse_jax.data import datasets as D
from sparse_jax.data.batches import ByteWindows, eval_windows, split_bytes
from sparse_jax.data.cifar10 import CIFAR10_SPLIT_SEED, CIFAR10_URL, cifar10_source, prepare_cifar10

# ---------------------------------------------------------------------------------------------
# enwik8 and byte files.


@pytest.mark.parametrize("n", [10**8, 1000, 21, 3])
def test_split_bytes_contiguous_with_paper_sizes(n):
    positions = range(n)  # sliced like an array, costs nothing even at 10^8
    for fractions in [sources.ENWIK8_FRACTIONS, (0.8, 0.1, 0.1)]:
        splits = [split_bytes(positions, fractions)[s] for s in D.SPLITS]
        assert [r.start for r in splits] == [0, splits[0].stop, splits[1].stop]  # contiguous
        assert splits[2].stop == n and all(r.step == 1 for r in splits)
        assert np.allclose([len(r) for r in splits], np.multiply(fractions, n), atol=1)
    if n == 10**8:
        splits = split_bytes(positions, sources.ENWIK8_FRACTIONS)
        assert [len(splits[s]) for s in D.SPLITS] == [90_000_000, 5_000_000, 5_000_000]
    with pytest.raises(ValueError):
        split_bytes(positions, (0.9, 0.05, 0.1))


def test_load_enwik8_from_zip_extracts_once_and_caches_verification(tmp_path, monkeypatch):
    zip_path, raw, md5 = fake_enwik8(tmp_path)
    data = sources.load_enwik8(zip_path, expected_size=len(raw), expected_md5=md5)
    assert isinstance(data, np.memmap) and data.dtype == np.uint8
    assert data.tobytes() == raw
    assert (tmp_path / "enwik8").read_bytes() == raw
    assert os.path.exists(tmp_path / "enwik8.verified")
    assert not [p for p in os.listdir(tmp_path) if ".part" in p]

    def no_hashing(*args, **kwargs):
        raise AssertionError("hashed again although size and mtime did not change")

    monkeypatch.setattr(sources.hashlib, "file_digest", no_hashing)
    again = sources.load_enwik8(tmp_path / "enwik8", expected_size=len(raw), expected_md5=md5)
    assert again.tobytes() == raw
    os.utime(tmp_path / "enwik8", ns=(1, 1))  # a changed file must be hashed again
    with pytest.raises(AssertionError, match="hashed again"):
        sources.load_enwik8(zip_path, expected_size=len(raw), expected_md5=md5)


def test_load_enwik8_wrong_checksum_or_size(tmp_path):
    zip_path, raw, md5 = fake_enwik8(tmp_path)
    with pytest.raises(ValueError, match="MD5"):
        sources.load_enwik8(zip_path, expected_size=len(raw), expected_md5="0" * 32)
    assert os.listdir(tmp_path) == ["enwik8.zip"]  # nothing half-extracted left behind
    with pytest.raises(ValueError, match="bytes"):
        sources.load_enwik8(zip_path)  # the real 10^8-byte size
    (tmp_path / "enwik8").write_bytes(raw[:-1])
    with pytest.raises(ValueError, match=f"{len(raw) - 1:,} bytes, expected {len(raw):,}"):
        sources.load_enwik8(zip_path, expected_size=len(raw), expected_md5=md5)
    (tmp_path / "enwik8").write_bytes(raw[::-1])
    with pytest.raises(ValueError, match="MD5"):
        sources.load_enwik8(zip_path, expected_size=len(raw), expected_md5=md5)


def test_extraction_never_replaces_an_existing_file(tmp_path):
    zip_path, raw, md5 = fake_enwik8(tmp_path)
    mine = b"my own notes, not enwik8"
    (tmp_path / "enwik8").write_bytes(mine)
    with pytest.raises(ValueError):
        sources.load_enwik8(zip_path, expected_size=len(raw), expected_md5=md5)
    assert (tmp_path / "enwik8").read_bytes() == mine


def test_missing_enwik8_says_what_to_download_and_where(tmp_path, monkeypatch):
    path = tmp_path / "corpora" / "enwik8"
    with pytest.raises(FileNotFoundError) as e:
        sources.load_enwik8(path)
    assert sources.ENWIK8_URL in str(e.value) and f"{path}.zip" in str(e.value)
    # Offline download fails fast with the same advice (port 9: connection refused at once).
    # One attempt with the socket timeout, no retries: the deterministic form of "fast".
    monkeypatch.setattr(sources, "ENWIK8_URL", "http://127.0.0.1:9/enwik8.zip")
    attempts = []
    urlopen = sources.urllib.request.urlopen
    monkeypatch.setattr(sources.urllib.request, "urlopen",
                        lambda url, timeout: attempts.append(timeout) or urlopen(url, timeout))
    with pytest.raises(FileNotFoundError, match="127.0.0.1:9/enwik8.zip") as e:
        sources.load_enwik8(path, download=True)
    assert attempts == [sources.DOWNLOAD_TIMEOUT_S]
    assert f"{path}.zip" in str(e.value) and not os.listdir(tmp_path / "corpora")


def test_make_dataset_enwik8_and_bytes(tmp_path, monkeypatch):
    zip_path, raw, md5 = fake_enwik8(tmp_path, size=2000)
    monkeypatch.setattr(sources, "ENWIK8_SIZE", len(raw))
    monkeypatch.setattr(sources, "ENWIK8_MD5", md5)
    ds = D.make_dataset({"name": "enwik8", "path": zip_path}, seq_len=16)
    assert ds.unit == "byte" and [len(ds.splits[s]) for s in D.SPLITS] == [1800, 100, 100]
    assert ds.splits["test"].tobytes() == raw[1900:]
    recorded = D.fingerprint({"name": "enwik8", "path": zip_path}, ds)  # verified: no hashing
    assert recorded == {"name": "enwik8", "path": zip_path, "size": 2000, "md5": md5}
    D.check_fingerprint(recorded, {"name": "enwik8", "path": str(tmp_path / "enwik8")})
    (tmp_path / "notes.png").write_bytes(raw)  # any file type
    config = ml_collections.ConfigDict(
        {"name": "bytes", "path": str(tmp_path / "notes.png"), "split_fractions": (0.5, 0.3, 0.2)})
    ds = D.make_dataset(config, seq_len=16)
    assert [len(ds.splits[s]) for s in D.SPLITS] == [1000, 600, 400]
    assert ds.splits["valid"].tobytes() == raw[1000:1600]
    with pytest.raises(ValueError, match="unknown dataset"):
        D.make_dataset({"name": "enwik9"}, seq_len=16)


def test_data_config_is_typed_validated_and_says_what_is_an_image():
    images = D.data_config(ml_collections.ConfigDict(
        {"name": "cifar10", "data_dir": None, "split_fractions": [0.8, 0.1, 0.1]}))
    assert images.is_image and images.image_shape == (32, 32, 3) and images.unit == "dim"
    assert images.split_fractions == (0.8, 0.1, 0.1) and images.seed == 0
    assert D.data_config(images) is images
    text = D.data_config({"name": "embedded"})
    assert not text.is_image and text.image_shape is None and text.unit == "byte"
    assert text.fractions == (0.9, 0.05, 0.05)
    assert D.data_config({"name": "enwik8", "path": "e"}).fractions == sources.ENWIK8_FRACTIONS
    for fields, match in [
            ({"name": "enwik9"}, r"DataConfig.name='enwik9': unknown dataset"),
            ({"name": "bytes"}, r"DataConfig.path=None: .*--config.data.path=FILE"),
            ({"name": "embedded", "seed": -1}, r"DataConfig.seed=-1: must be an integer >= 0"),
            ({"name": "embedded", "seed": True}, r"DataConfig.seed=True"),
            ({"name": "embedded", "embedded_bytes": 0}, r"DataConfig.embedded_bytes=0"),
            ({"name": "embedded", "embedded_row_width": 1},
             r"DataConfig.embedded_row_width=1: must be an integer >= 2"),
            ({"name": "embedded", "embedded_copy_distance": 0},
             r"DataConfig.embedded_copy_distance=0"),
            ({"name": "embedded", "download": "yes"}, r"DataConfig.download='yes'"),
            ({"name": "embedded", "split_fractions": (0.9, 0.05, 0.1)},
             r"DataConfig.split_fractions=\(0.9, 0.05, 0.1\): must be 3 non-negative"),
            ({"name": "embedded", "split_fractions": 0.9}, r"DataConfig.split_fractions=0.9"),
            ({"name": "embedded", "shuffle": 1}, r"unknown data config field\(s\) \['shuffle'\]"),
            ({"path": "e"}, "missing data config field 'name'")]:
        with pytest.raises(ValueError, match=match) as e:
            D.data_config(fields)
        assert "\n" not in str(e.value)


def test_gz_byte_file_is_decompressed_once_checked_and_mapped(tmp_path, monkeypatch):
    raw = bytes(range(256)) * 40
    gz = gz_with_sums(tmp_path, raw)
    data = sources.load_bytes(gz)
    assert isinstance(data, np.memmap) and data.tobytes() == raw
    assert (tmp_path / "text.txt").read_bytes() == raw  # the cache, next to the .gz
    assert not [p for p in os.listdir(tmp_path) if ".part" in p]

    def no_work(*args, **kwargs):
        raise AssertionError("decompressed or hashed again although nothing changed")

    monkeypatch.setattr(sources.gzip, "open", no_work)
    monkeypatch.setattr(sources.hashlib, "file_digest", no_work)
    assert sources.load_bytes(gz).tobytes() == raw
    os.utime(gz, ns=(1, 1))  # a changed .gz is checked and decompressed again
    with pytest.raises(AssertionError, match="again"):
        sources.load_bytes(gz)


def test_damaged_gz_or_cache_gives_one_line_error_and_keepsfiles_in(tmp_path):
    raw = b"In the beginning God created the heaven and the earth.\n" * 200
    gz = gz_with_sums(tmp_path, raw)
    good = open(gz, "rb").read()
    with open(gz, "wb") as f:  # truncated copy: its sha256 no longer matches SHA256SUMS
        f.write(good[:len(good) // 2])
    with pytest.raises(ValueError, match="damaged.*git checkout") as e:
        sources.load_bytes(gz)
    assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "text.txt")
    # Not listed: a user's own file, not one of the repository's (git checkout cannot restore
    # it): the truncated or corrupt stream is reported with what the user can do about it,
    # with the flag that named it, and nothing is left behind.
    os.remove(tmp_path / "SHA256SUMS")
    for damage in ["truncated", "corrupt", "not gzip"]:
        if damage == "corrupt":
            gz_with_sums(tmp_path, raw, listed=False)
            corrupt_middle(gz)
        if damage == "not gzip":
            with open(gz, "wb") as f:
                f.write(raw)
        before = files_in(tmp_path)
        with pytest.raises(ValueError) as e:
            D.make_dataset({"name": "bytes", "path": gz}, 8)
        message = str(e.value)
        assert "\n" not in message and "git checkout" not in message
        assert f"{gz} is damaged or not a gzip file" in message and "gzip -f FILE (not -k" \
            in message and "set --config.data.path=FILE.gz" in message
        assert "set --config.data.path to the uncompressed file" in message
        one_line_error(ValueError, lambda: sources.load_bytes(gz, "--data"), gz,
                       "set --data to the uncompressed file")
        assert files_in(tmp_path) == before and list(before) == ["text.txt.gz"]
    # A shipped corpus whose SHA256SUMS lists only its decompressed bytes is restored with git.
    with open(tmp_path / "SHA256SUMS", "w") as f:
        f.write(f"{hashlib.sha256(raw).hexdigest()}  text.txt\n")
    one_line_error(ValueError, lambda: sources.load_bytes(gz), gz, "not a complete gzip file",
                   "git checkout")
    os.remove(tmp_path / "SHA256SUMS")
    # Listed content differs from what the stream decompresses to.
    gz = gz_with_sums(tmp_path, raw)
    with open(tmp_path / "SHA256SUMS") as f:
        lines = f.read().splitlines()
    with open(tmp_path / "SHA256SUMS", "w") as f:
        f.write(lines[0] + "\n" + "0" * 64 + "  text.txt\n")
    with pytest.raises(ValueError, match="decompresses to"):
        sources.load_bytes(gz)
    # A file the loader did not write is never replaced by the decompressed copy.
    (tmp_path / "text.txt").write_bytes(b"mine")
    with pytest.raises(ValueError, match="exists but was not decompressed"):
        sources.load_bytes(gz)
    assert (tmp_path / "text.txt").read_bytes() == b"mine"
    # A listed plain file is checked too.
    with pytest.raises(ValueError, match="damaged"):
        sources.load_bytes(tmp_path / "text.txt")


@pytest.mark.parametrize("advice", ["gzip -f FILE", "the uncompressed file"])
def test_the_damaged_gz_advice_is_one_the_next_run_accepts(tmp_path, advice):
    """A user's .gz is damaged and the original is at hand: each fix the one line names (the
    uncompressed file itself, or gzip -f FILE, which leaves no FILE beside FILE.gz) loads on
    the next run. (gzip -k, the old advice, kept FILE beside the .gz, which is refused.)"""
    import shutil
    import subprocess

    raw = b"Call me Ishmael. Some years ago, never mind how long precisely.\n" * 100
    folder = tmp_path / "data"
    folder.mkdir()
    gz = gz_with_sums(folder, raw, listed=False)
    corrupt_middle(gz)
    message = one_line_error(ValueError, lambda: sources.load_bytes(gz, "--data"), gz,
                             "is damaged or not a gzip file")
    assert advice in message
    original = folder / "text.txt"  # the user's original, where gzip would put it back
    original.write_bytes(raw)
    if advice == "gzip -f FILE":
        if shutil.which("gzip"):
            subprocess.run(["gzip", "-f", str(original)], check=True)
        else:  # what gzip -f FILE does: FILE.gz written over the damaged one, FILE removed
            with open(original, "rb") as f, gzip.open(gz, "wb") as out:
                out.write(f.read())
            original.unlink()
        assert sorted(os.listdir(folder)) == ["text.txt.gz"]
        assert sources.load_bytes(gz, "--data").tobytes() == raw
    else:
        assert sources.load_bytes(original, "--data").tobytes() == raw


def test_a_data_path_that_is_not_a_regular_file_is_one_line_without_blocking(tmp_path):
    """A pipe (bash's <(cat file) is /dev/fd/N), a FIFO with no writer (opening it would wait
    forever), a device (/dev/zero) or a socket: refused from os.stat in one line that says
    what it is, whatever the option that named it; nothing written beside it."""
    import threading

    fifo, sock_path = tmp_path / "fifo", tmp_path / "sock"
    os.mkfifo(fifo)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    read_end, write_end = os.pipe()
    cases = [(fifo, "a pipe (FIFO)"), (f"/dev/fd/{read_end}", "a pipe (FIFO)"),
             ("/dev/zero", "a character device"), (sock_path, "a socket")]
    try:
        for path, kind in cases:
            for flag, call in [("--data", lambda p=path: sources.load_bytes(p, "--data")),
                               ("--config.data.path", lambda p=path: D.make_dataset(
                                   {"name": "bytes", "path": str(p)}, 8))]:
                outcome = []

                def attempt(call=call, outcome=outcome):
                    try:
                        call()
                        outcome.append(None)
                    except Exception as e:  # noqa: BLE001  (checked below)
                        outcome.append(e)

                worker = threading.Thread(target=attempt, daemon=True)
                worker.start()
                worker.join(timeout=30)
                assert outcome, f"{path}: blocked"
                assert isinstance(outcome[0], OSError), (path, outcome)
                message = str(outcome[0].strerror)
                assert "\n" not in message and message == (
                    f"data path {path} is {kind}, not a regular file: the data is "
                    f"memory-mapped and read more than once; save it to a file (e.g. cat ... > "
                    f"FILE) and set {flag}=FILE"), message
        assert sorted(os.listdir(tmp_path)) == ["fifo", "sock"]
    finally:
        server.close()
        os.close(read_end)
        os.close(write_end)


def test_full_disk_while_decompressing_is_one_line_and_the_next_load_succeeds(tmp_path,
                                                                               monkeypatch):
    """The disk fills up 256 KB into the decompressed copy of a listed .gz: one line that says
    so and names the copy, no part of it left, the .gz and its sums untouched; with space freed,
    the next load decompresses it whole."""
    raw = sources.embedded_bytes(1 << 20, seed=3).tobytes()
    gz = gz_with_sums(tmp_path, raw)
    before = files_in(tmp_path)
    real_open = open

    class FullAfter:  # a file on a disk with `left` bytes free
        def __init__(self, f, left):
            self.f, self.left = f, left

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):  # flush, fileno, name
            return getattr(self.f, name)

        def write(self, data):
            if len(data) > self.left:
                self.f.write(data[:self.left])
                self.left = 0
                raise OSError(errno.ENOSPC, "No space left on device")
            self.left -= len(data)
            return self.f.write(data)

    def opener(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullAfter(f, 1 << 18) if "w" in mode else f

    monkeypatch.setattr(files, "open", opener, raising=False)  # what atomic_write opens
    one_line_error(OSError, lambda: sources.load_bytes(gz), tmp_path / "text.txt",
                   "the disk is full", "free some space", "--config.data.path")
    after = files_in(tmp_path)
    assert {n: after[n] for n in before} == before  # nothing lost or changed
    assert set(after) - set(before) <= {"text.txt.gz.verified"}  # the .gz's passing check
    monkeypatch.undo()  # space freed
    assert sources.load_bytes(gz).tobytes() == raw
    assert (tmp_path / "text.txt").read_bytes() == raw


# ---------------------------------------------------------------------------------------------
# Data errors: one line naming the file and the fix, before compiling; nothing of the user's lost.


def test_missing_folder_unreadable_or_empty_data_file(tmp_path, monkeypatch):
    make = lambda path, name="bytes": D.make_dataset({"name": name, "path": path}, 8)  # noqa: E731
    nope, empty, text = tmp_path / "nope.txt", tmp_path / "empty.txt", tmp_path / "x.txt"
    one_line_error(FileNotFoundError, lambda: make(nope), nope, "--config.data.path")
    one_line_error(IsADirectoryError, lambda: make(tmp_path), tmp_path, "is a folder",
                   "a model of bytes reads a file", "set --config.data.path to a file")
    # The option that named the file is the one the errors name (scripts/evaluate.py: --data).
    for call in [lambda: sources.load_bytes(nope, "--data"), lambda: D.make_dataset(
            {"name": "bytes", "path": tmp_path}, 8, path_flag="--data")]:
        with pytest.raises(OSError) as e:
            call()
        assert "set --data to" in str(e.value) and "--config" not in str(e.value)
    one_line_error(IsADirectoryError, lambda: make(tmp_path, "enwik8"), tmp_path, "is a folder")
    empty.write_bytes(b"")
    one_line_error(ValueError, lambda: make(empty), empty, "is empty")
    text.write_bytes(b"abc" * 100)
    denied = mock.Mock(side_effect=PermissionError(13, "Permission denied"))  # tests run as root
    monkeypatch.setattr(sources, "open", denied, raising=False)
    one_line_error(OSError, lambda: make(text), text, "Permission denied", "chmod")
    assert files_in(tmp_path) == {"empty.txt": b"", "x.txt": b"abc" * 100}


@pytest.mark.parametrize("damage", ["not_zip", "truncated", "corrupt", "no_member"])
def test_damaged_enwik8_zip_one_line_error_keeps_it(tmp_path, monkeypatch, damage):
    zip_path, raw, md5 = fake_enwik8(tmp_path, size=20_000)
    monkeypatch.setattr(sources, "ENWIK8_SIZE", len(raw))
    monkeypatch.setattr(sources, "ENWIK8_MD5", md5)
    if damage == "not_zip":
        (tmp_path / "enwik8.zip").write_bytes(b"<html>404 Not Found</html>")
    elif damage == "truncated":
        (tmp_path / "enwik8.zip").write_bytes(open(zip_path, "rb").read()[:5000])
    elif damage == "corrupt":
        corrupt_middle(zip_path)
    else:
        fake_enwik8(tmp_path, size=20_000, member="enwik9")
    before = files_in(tmp_path)
    why = "no member 'enwik8'" if damage == "no_member" else "damaged or not a zip archive"
    one_line_error(ValueError, lambda: D.make_dataset({"name": "enwik8", "path": zip_path}, 8),
                   zip_path, why, sources.ENWIK8_URL)
    assert files_in(tmp_path) == before  # nothing extracted, the archive untouched


def test_splits_too_small_for_their_use_are_refused_at_start(tmp_path):
    path = tmp_path / "x.txt"
    path.write_bytes(bytes(range(100)) * 9)
    make = lambda f, n=64: D.make_dataset(  # noqa: E731
        {"name": "bytes", "path": str(path), "split_fractions": f}, n)
    one_line_error(ValueError, lambda: make((0.999, 0.001, 0)), path,
                   "the valid split (split_fractions[1]=0.001 of 900 bytes) has 1 bytes",
                   "validation needs at least 2", "--config.data.split_fractions")
    one_line_error(ValueError, lambda: make((0.07, 0.9, 0.03)), path, "needs at least 65",
                   "the train split (split_fractions[0]=0.07 of 900 bytes) has 63 bytes", "seq_len")
    ds = make((0.08, 0.92, 0), 71)  # 72 train bytes: exactly one window
    assert len(ds.train_batches(2).starts_at(0)) == 2
    one_line_error(ValueError, lambda: ds.check_split("test"), path, "test split", "has 0 bytes")
    assert ds.check_split("valid") == ds.num_sequences("valid") > 0
    one_line_error(ValueError, lambda: D.make_dataset({"name": "embedded", "embedded_bytes": 50},
                                                      64), "'embedded' stream (50 bytes)",
                   "--config.data.embedded_bytes")
    assert files_in(tmp_path) == {"x.txt": bytes(range(100)) * 9}
    # Data only scored or measured (evaluation, scripts/repeats.py) is not held to training's
    # needs: ten bytes load, and the split that is read is checked by its reader.
    path.write_bytes(b"0123456789")
    ds = D.make_dataset({"name": "bytes", "path": str(path)}, 64, training=False)
    assert [len(ds.splits[s]) for s in D.SPLITS] == [9, 1, 0]
    assert ds.scorable("test") == ["--split=train (9 bytes)"]
    one_line_error(ValueError, lambda: ds.check_split("test", instead="score another --split"),
                   path, "has 0 bytes", "score another --split")


def test_vocabulary_must_cover_the_data(tmp_path, byte_file, monkeypatch):
    path = tmp_path / "x.txt"
    path.write_bytes(b"a" * 500 + b"\xc8" + b"b" * 499)
    config = {"name": "bytes", "path": str(path), "split_fractions": (0.8, 0.1, 0.1)}
    one_line_error(ValueError, lambda: D.make_dataset(config, 8, vocab_size=128), path,
                   "byte value 200 at offset 500", "outside model.vocab_size=128",
                   "--config.model.vocab_size=256")
    D.make_dataset({"name": "bytes", "path": byte_file}, 8, vocab_size=127)  # printable bytes
    monkeypatch.setattr(D.np, "max", None)  # 256 covers every byte: nothing is read
    D.make_dataset(config, 8, vocab_size=256)
    assert path.read_bytes()[500] == 200


def test_fingerprint_detects_a_changed_data_file(tmp_path):
    path, moved = tmp_path / "x.txt", tmp_path / "moved.txt"
    content = sources.embedded_bytes(3000, seed=1).tobytes()
    path.write_bytes(content)
    config = {"name": "bytes", "path": str(path)}
    recorded = json.loads(json.dumps(D.fingerprint(config, D.make_dataset(config, 16))))
    assert recorded == D.fingerprint(config) and recorded["size"] == 3000
    os.utime(path, ns=(1, 1))  # touched, same bytes: unchanged
    assert D.check_fingerprint(recorded, config) == recorded
    os.rename(path, moved)  # a moved file is the same data ("path" is not compared)
    D.check_fingerprint(recorded, {**config, "path": str(moved)})
    moved.write_bytes(content[::-1])
    one_line_error(ValueError, lambda: D.check_fingerprint(recorded, {**config, "path": moved}),
                   moved, f"is not the data this run started with, {path} (sha256 ")
    path.write_bytes(content + b"more")
    one_line_error(ValueError, lambda: D.check_fingerprint(recorded, config), path,
                   "changed since this run started (size 3000 -> 3004)", "--workdir")
    assert path.read_bytes() == content + b"more" and moved.read_bytes() == content[::-1]
    assert D.check_fingerprint(None, config)["size"] == 3004  # nothing recorded: no check
    embedded = {"name": "embedded", "embedded_bytes": 5000}
    assert D.fingerprint(embedded) == D.fingerprint(embedded, D.make_dataset(embedded, 16))
    one_line_error(ValueError, lambda: D.check_fingerprint(
        D.fingerprint(embedded), {**embedded, "embedded_seed": 1}), "'embedded' stream")


def test_shipped_corpus_matches_its_published_checksums():
    """The repository's corpus is read through the real loader and is the listed file."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    data = sources.load_bytes(os.path.join(root, sources.CORPUS))
    assert len(data) == 4_780_876
    assert bytes(data[:15]) == b"<!DOCTYPE HTML "
    splits = split_bytes(data)
    assert 4.7 < sources.unigram_entropy_bits(splits["train"]) < 4.9


# ---------------------------------------------------------------------------------------------
# Training windows and evaluation windows.


def test_byte_windows_are_shifted_slices_in_bounds():
    data = np.random.default_rng(1).integers(0, 256, size=300, dtype=np.uint8)
    it = ByteWindows(data, seq_len=32, batch_size=8, seed=3)
    all_starts = []
    for step in range(40):
        starts = it.starts_at(step)
        batch = next(it)
        assert batch["inputs"].shape == batch["targets"].shape == (8, 32)
        assert batch["inputs"].dtype == np.int32
        for row, s in enumerate(starts):
            np.testing.assert_array_equal(batch["inputs"][row], data[s:s + 32])
            np.testing.assert_array_equal(batch["targets"][row], data[s + 1:s + 33])
        all_starts.extend(starts)
    assert min(all_starts) >= 0 and max(all_starts) == len(data) - 33  # last window fits exactly


def test_embedded_stream_copies_at_the_configured_distance():
    """data.embedded_row_width / embedded_copy_distance set where the copies sit: here 65 rows
    of 32 bytes, 2,080 bytes back (the defaults: 128)."""
    far = D.make_dataset({"name": "embedded", "embedded_bytes": 200_000,
                          "embedded_copy_distance": 65}, seq_len=64).splits["train"]
    near = D.make_dataset({"name": "embedded", "embedded_bytes": 200_000}, seq_len=64)
    rows = far.reshape(-1, 32)

    def repeats(rows, back):  # share of rows equal to the row `back` rows earlier
        return (rows[back:] == rows[:-back]).all(1).mean()

    assert repeats(rows, 65) > 0.7 and repeats(rows, 4) < 0.05
    assert repeats(near.splits["train"].reshape(-1, 32), 4) > 0.7
    assert D.fingerprint({"name": "embedded", "embedded_bytes": 200_000}) != D.fingerprint(
        {"name": "embedded", "embedded_bytes": 200_000, "embedded_copy_distance": 65})


def test_train_batches_resume_exactly_and_differ_per_process():
    ds = D.make_dataset({"name": "embedded", "embedded_bytes": 20_000, "seed": 5}, seq_len=64)
    it = ds.train_batches(batch_size=4)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert state == {"seed": 5, "step": 3}
    expected = [next(it) for _ in range(2)]
    resumed = ds.train_batches(batch_size=4, state=state)
    for want in expected:
        got = next(resumed)
        np.testing.assert_array_equal(got["inputs"], want["inputs"])
        np.testing.assert_array_equal(got["targets"], want["targets"])
    other = D.make_dataset({"name": "embedded", "embedded_bytes": 20_000, "seed": 5}, seq_len=64,
                           process_index=1, process_count=2).train_batches(batch_size=4)
    other.set_state(state)
    assert not np.array_equal(next(other)["inputs"], expected[0]["inputs"])


def test_context_stages_switch_window_length_and_resume_in_the_right_stage():
    """Steps before 3 read 4 windows of 16 bytes, the rest 2 of 64: each step's windows are
    those of a plain iterator of its shape at that step, and a resume lands in the right stage."""
    ds = D.make_dataset({"name": "embedded", "embedded_bytes": 20_000, "seed": 5}, seq_len=64)
    it = ds.train_batches(batch_size=2, stages=((3, 16, 4),))
    got = [next(it) for _ in range(5)]
    assert [b["inputs"].shape for b in got] == [(4, 16)] * 3 + [(2, 64)] * 2
    short = ByteWindows(ds.splits["train"], 16, 4, seed=5)
    np.testing.assert_array_equal(got[1]["targets"], short.batch_at(1)["targets"])
    np.testing.assert_array_equal(got[4]["inputs"], ds.train_batches(2).batch_at(4)["inputs"])
    for step in (2, 4):
        resumed = ds.train_batches(batch_size=2, stages=((3, 16, 4),),
                                   state={"seed": 5, "step": step})
        np.testing.assert_array_equal(next(resumed)["inputs"], got[step]["inputs"])
    resumed.set_state({"seed": 6, "step": 0})  # a new seed reaches every stage's iterator
    assert not np.array_equal(next(resumed)["inputs"], got[0]["inputs"])


def test_global_training_batch_does_not_depend_on_the_process_count():
    """Two processes reading 4 windows each see the 8 windows that one process reads: a
    multi-host run trains on the same batches as a single-host run."""
    config = {"name": "embedded", "embedded_bytes": 20_000, "seed": 2}
    whole = D.make_dataset(config, seq_len=64).train_batches(batch_size=8)
    halves = [D.make_dataset(config, seq_len=64, process_index=p, process_count=2)
              .train_batches(batch_size=4) for p in range(2)]
    for _ in range(3):
        want = next(whole)
        got = [next(h) for h in halves]
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), want[key])


@pytest.mark.parametrize("n,seq_len,m", [(1000, 64, None), (1000, 64, 0), (1000, 64, 32),
                                         (1000, 64, 63), (65, 64, 10), (64, 64, None),
                                         (10, 64, 5), (2, 4, 1), (777, 100, 90)])
def test_eval_windows_score_every_byte_once(n, seq_len, m):
    windows = eval_windows(np.zeros(n, np.uint8), seq_len, m)
    counts = np.zeros(n, int)
    for w, (s, a, b) in enumerate(zip(*windows)):
        assert 0 <= a < b <= seq_len
        if w > 0:  # overlapping windows: stride L - m, score only positions with >= m context
            assert s - windows.starts[w - 1] == seq_len - (m or 0) and a == (m or 0)
        counts[s + 1 + a:s + 1 + b] += 1  # position j predicts data[s + j + 1]
    assert counts[0] == 0 and np.all(counts[1:] == 1)


@pytest.mark.parametrize("m,process_count", [(None, 1), (48, 1), (20, 2)])
def test_eval_batches_mask_and_targets_align(m, process_count):
    data = np.random.default_rng(2).integers(0, 256, size=1001, dtype=np.uint8)
    splits = {"train": data, "valid": data, "test": data}
    scored = []
    for p in range(process_count):
        ds = D.ByteDataset("bytes", 64, splits, process_index=p, process_count=process_count)
        windows = eval_windows(data, 64, m)
        assert ds.num_sequences("valid", m) == len(windows.starts)
        for k, batch in enumerate(ds.eval_batches("valid", batch_size=3, min_context=m)):
            assert batch["mask"].shape == (3, 64) and batch["mask"].dtype == bool
            for row in range(3):
                w = (k * process_count + p) * 3 + row
                j = np.flatnonzero(batch["mask"][row])
                if w >= len(windows.starts):
                    assert len(j) == 0  # padding row
                    continue
                t = windows.starts[w] + 1 + j
                np.testing.assert_array_equal(batch["targets"][row, j], data[t])
                np.testing.assert_array_equal(batch["inputs"][row, j], data[t - 1])
                scored.extend(t)
    assert sorted(scored) == list(range(1, len(data)))


# ---------------------------------------------------------------------------------------------
# CIFAR-10 through the real TFDS builder, from a tiny archive in the official binary format.

def test_cifar10_pixels_in_raster_order_and_paper_split(cifar):
    data_dir, expected = cifar
    num_train = 5 * TRAIN_PER_FILE
    train, valid, test = (cifar10_source(s, data_dir, valid_size=4) for s in D.SPLITS)
    assert (len(train), len(valid), len(test)) == (num_train - 4, 4, NUM_TEST)
    assert sorted([*train.indices, *valid.indices]) == list(range(num_train))
    perm = np.random.default_rng(CIFAR10_SPLIT_SEED).permutation(num_train)
    np.testing.assert_array_equal(valid.indices, np.sort(perm[-4:]))  # fixed-seed permutation
    seen = set()
    for source in (train, valid, test):
        idx = np.arange(len(source))
        images = source.images(idx)
        assert images.dtype == np.uint8 and images.shape == (len(source), 3072)
        for example, image in zip(source.examples(idx), images):
            name = example["id"].decode()
            np.testing.assert_array_equal(image, expected[name])
            seen.add(name)
    assert seen == set(expected)
    assert prepare_cifar10(data_dir) == os.path.join(data_dir, "cifar10", "3.0.2")  # reused


def test_cifar10_batches_shuffle_shard_and_resume(cifar, monkeypatch):
    data_dir, expected = cifar
    monkeypatch.setattr(cifar10, "CIFAR10_VALID_SIZE", 4)
    config = {"name": "cifar10", "data_dir": data_dir, "seed": 7}
    shards = [D.make_dataset(config, 3072, process_index=p, process_count=2) for p in range(2)]
    ds = shards[0]
    assert ds.unit == "dim" and [len(ds.splits[s]) for s in D.SPLITS] == [16, 4, NUM_TEST]
    its = [s.train_batches(batch_size=2) for s in shards]
    assert its[0].steps_per_epoch == 4  # 16 images / global batch 4
    epoch = np.concatenate([np.concatenate([it.indices_at(k) for it in its]) for k in range(4)])
    assert sorted(epoch) == list(range(16))  # one epoch: every image once, split over processes
    batch = next(its[0])
    np.testing.assert_array_equal(batch["targets"], ds.splits["train"].images(its[0].indices_at(0)))
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert np.all(batch["inputs"][:, 0] == 0)
    for _ in range(4):  # across the epoch boundary
        next(its[0])
    want = next(its[0])
    resumed = ds.train_batches(batch_size=2, state={"seed": 7, "step": 5})
    np.testing.assert_array_equal(next(resumed)["targets"], want["targets"])
    # 5 test images in one global batch of 2 x 4: process 0 reads 0-3, process 1 reads 4 + padding.
    batches = [list(s.eval_batches("test", batch_size=4)) for s in shards]
    assert [len(b) for b in batches] == [1, 1]
    mask = np.concatenate([b[0]["mask"] for b in batches])
    assert mask.shape == (8, 3072) and mask[:5].all() and not mask[5:].any()
    targets = np.concatenate([b[0]["targets"] for b in batches])
    np.testing.assert_array_equal(targets[:5], ds.splits["test"].images(range(5)))
    assert ds.num_sequences("test") == NUM_TEST
    with pytest.raises(ValueError, match="byte data only"):
        next(ds.eval_batches("test", batch_size=4, min_context=8))
    with pytest.raises(ValueError, match="3072"):
        D.make_dataset(config, 1024)
    one_line_error(ValueError, lambda: ds.train_batches(batch_size=9), f"CIFAR-10 in {data_dir}",
                   "train split has 16 images", "global batch of 9 x 2", "--config.batch_size")
    one_line_error(ValueError, lambda: D.check_vocabulary(ds, 255), "sub-pixels", "size=256")
    recorded = D.fingerprint(config)
    assert recorded["num_examples"] == {"train": 5 * TRAIN_PER_FILE, "test": NUM_TEST}
    assert D.check_fingerprint(recorded, config) == recorded
    old = {**recorded, "tfds_version": "3.0.1"}
    one_line_error(ValueError, lambda: D.check_fingerprint(old, config),
                   f"CIFAR-10 in {data_dir} changed", "tfds_version 3.0.1 -> 3.0.2")


def test_cifar10_missing_or_wrong_archive_fails_fast_in_one_line(tmp_path, monkeypatch):
    tfds_dir, manual = str(tmp_path / "tfds"), tmp_path / "manual"
    config = {"name": "cifar10", "data_dir": tfds_dir, "manual_dir": str(manual)}

    def no_network(*args, **kwargs):  # "fast": nothing is fetched or retried without download
        raise AssertionError(f"network used: {args}")

    with monkeypatch.context() as m:
        m.setattr(sources.urllib.request, "urlopen", no_network)
        m.setattr(socket, "create_connection", no_network)
        one_line_error(FileNotFoundError, lambda: D.prepare(config), CIFAR10_URL,
                       manual / "cifar-10-binary.tar.gz")
        one_line_error(FileNotFoundError, lambda: cifar10_source("train", tfds_dir),
                       "prepare_cifar10")
    archive = manual / "cifar-10-binary.tar.gz"
    manual.mkdir()
    archive.write_bytes(b"\x1f\x8b truncated")  # an interrupted download
    one_line_error(ValueError, lambda: D.prepare(config), archive,
                   "has 12 bytes, expected 170,052,171", CIFAR10_URL)
    assert archive.read_bytes() == b"\x1f\x8b truncated"
    from tensorflow_datasets.core.download import checksums
    from tensorflow_datasets.image_classification import cifar as tfds_cifar

    wrong = checksums.UrlInfo(size=12, checksum="0" * 64, filename=archive.name)  # right size
    monkeypatch.setattr(tfds_cifar.Cifar10, "url_infos", {CIFAR10_URL: wrong})
    one_line_error(ValueError, lambda: D.prepare(config), archive, "SHA-256", CIFAR10_URL)
    assert archive.read_bytes() == b"\x1f\x8b truncated"


# ---------------------------------------------------------------------------------------------
# Embedded quickstart data.


def test_embedded_is_deterministic_with_documented_structure():
    w, k, p = 32, 4, 0.75
    x = sources.embedded_bytes(64_000 + 7, seed=3)
    assert len(x) == 64_007 and x.dtype == np.uint8
    np.testing.assert_array_equal(x, sources.embedded_bytes(64_007, seed=3))
    assert not np.array_equal(x, sources.embedded_bytes(64_007, seed=4))
    rows = x[:64_000].reshape(-1, w)
    assert np.all(rows[:, -1] == ord("\n")) and not np.any(rows[:, :-1] == ord("\n"))
    copies = np.all(rows[k:] == rows[:-k], axis=1)
    assert abs(copies.mean() - p) < 0.02  # rows that repeat the row k back
    assert np.all(rows[1:] == rows[:-1], axis=1).mean() < 0.01  # no copies at distance 1
    fresh = rows[k:][~copies][:, :-1]
    successors = {}
    for a, b in zip(fresh[:, :-1].ravel(), fresh[:, 1:].ravel()):
        successors.setdefault(a, set()).add(b)
    assert len(successors) == 16 and all(len(s) == 8 for s in successors.values())
    unigram = sources.unigram_entropy_bits(x)
    assert 4.0 < unigram < 4.15
    best, local = sources.embedded_entropy_rate(), sources.embedded_entropy_rate(sees_copies=False)
    assert np.isclose(local, (4 + 30 * 3) / 32)  # log2(16) + 30 log2(8) bits per 32-byte row
    assert np.isclose(best, (0.8113 + 0.25 * 94) / 32, atol=1e-3)  # + H(0.75), 1/4 rows fresh
    assert best < unigram / 2 < local  # "half the unigram entropy" needs the long-range copies


def test_embedded_is_reproducible_and_unigram_entropy_is_exact():
    x = sources.embedded_bytes(4_000_000, seed=0)
    assert np.array_equal(x, sources.embedded_bytes(4_000_000, seed=0))
    assert np.isclose(sources.unigram_entropy_bits(np.arange(256, dtype=np.uint8)), 8)
    assert sources.unigram_entropy_bits(np.full(10, 7, np.uint8)) == 0
    assert len(x) == 4_000_000
