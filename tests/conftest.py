"""Shared fixtures: small files in the real dataset formats, and a session compilation cache."""

import hashlib
import io
import os
import shutil
import tarfile
import tempfile
import zipfile

import jax
import numpy as np
import pytest

from sparse_jax import data as D

# One persistent compilation cache for the session, shared with the subprocesses tests start:
# runs of the same tiny config (in-process or scripts/train.py) compile once, not every time.
_JAX_CACHE = tempfile.mkdtemp(prefix="sparse_jax_tests_jax_cache_")
for _name, _value in [("jax_compilation_cache_dir", _JAX_CACHE),
                      ("jax_persistent_cache_min_compile_time_secs", 0),
                      ("jax_persistent_cache_min_entry_size_bytes", 0)]:
    jax.config.update(_name, _value)
    os.environ[_name.upper()] = str(_value)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_JAX_CACHE, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# enwik8.


def fake_enwik8(folder, size=5000, seed=0):
    """A tiny enwik8.zip (single member `enwik8`); returns (zip path, bytes, md5)."""
    raw = np.random.default_rng(seed).integers(32, 127, size=size, dtype=np.uint8).tobytes()
    path = os.path.join(folder, "enwik8.zip")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("enwik8", raw)
    return path, raw, hashlib.md5(raw).hexdigest()


# ---------------------------------------------------------------------------------------------
# CIFAR-10 through the real TFDS builder, from a tiny archive in the official binary format.

TRAIN_PER_FILE, NUM_TEST = 4, 5


def cifar_batch_file(rng, n):
    """Records of 1 label byte + 3,072 bytes (R plane, G plane, B plane, each 32x32 row-major)."""
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    planes = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
    raw = np.concatenate([labels[:, None], planes.reshape(n, -1)], axis=1).tobytes()
    return raw, planes.transpose(0, 2, 3, 1).reshape(n, -1)  # expected raster order (r, c, ch)


@pytest.fixture(scope="session")
def cifar(tmp_path_factory):
    """Prepares the real `cifar10` builder once from a tiny archive; yields (data_dir, images)."""
    root = tmp_path_factory.mktemp("cifar")
    manual = root / "manual"
    manual.mkdir()
    rng = np.random.default_rng(0)
    members, expected = {}, {}
    for i in range(1, 6):
        raw, images = cifar_batch_file(rng, TRAIN_PER_FILE)
        members[f"data_batch_{i}.bin"] = raw
        for j, image in enumerate(images):
            expected[f"train_{(i - 1) * TRAIN_PER_FILE + j:05d}"] = image
    raw, images = cifar_batch_file(rng, NUM_TEST)
    members["test_batch.bin"] = raw
    expected.update({f"test_{j:05d}": image for j, image in enumerate(images)})
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
             "truck"]
    members["batches.meta.txt"] = "\n".join(names + ["", ""]).encode()
    archive = manual / "cifar-10-binary.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))

    from tensorflow_datasets.core.download import checksums
    from tensorflow_datasets.image_classification import cifar as tfds_cifar

    recorded = tfds_cifar.Cifar10.url_infos[D.CIFAR10_URL]  # the real record, before patching
    assert recorded.filename == archive.name and recorded.size == 170_052_171
    content = archive.read_bytes()
    tiny = checksums.UrlInfo(size=len(content), checksum=hashlib.sha256(content).hexdigest(),
                             filename=archive.name)
    data_dir = root / "tfds"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tfds_cifar.Cifar10, "url_infos", {D.CIFAR10_URL: tiny})
        prepared = D.prepare_cifar10(str(data_dir), str(manual))
    assert any(name.startswith("cifar10-train.array_record") for name in os.listdir(prepared))
    return str(data_dir), expected
