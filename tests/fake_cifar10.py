r"""Small CIFAR-10 archives in the official binary format, prepared through the real TFDS
`cifar10` builder: the `cifar` test fixture (random pixels) and a synthetic image task for the
pattern study (`--images=shapes`).

  python tests/fake_cifar10.py --root=workdirs/shapes_cifar10 --images=shapes \
      --train_per_file=600 --num_test=500

writes ROOT/manual/cifar-10-binary.tar.gz and prepares it into ROOT/tfds (give that folder to the
trainer as --config.data.data_dir). The real builder checks the archive against the official
size and SHA-256, so `prepare` substitutes this archive's for the duration of the preparation;
the preparation code itself is the real one. `data.sources` holds out CIFAR10_VALID_SIZE =
2,000 training images for validation, so a dataset for the command line needs more than 2,000
training images (5 x train_per_file); tests lower CIFAR10_VALID_SIZE instead.

Images (uint8 [n, 32, 32, 3], raster order row, column, channel):
- noise: every sub-pixel uniform in 0..255 (8 bits/dim; nothing to learn, exact pixels to check);
- shapes: 1-4 full-height vertical stripes of random colours, then 1-2 rectangles of random
  colours, then independent noise uniform in -2..2 on every sub-pixel (clipped to 0..255), which
  puts the floor at about log2(5) = 2.32 bits/dim. A colour edge is predictable from the pixel
  above (96 sub-pixels back), not from the pixels to its left.
"""

import hashlib
import io
import os
import sys
import tarfile
from unittest import mock

import numpy as np

LABEL_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
               "truck"]


def noise_images(rng, n):
    planes = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)  # as the format stores
    return planes.transpose(0, 2, 3, 1)


def shapes_images(rng, n):
    images = np.empty((n, 32, 32, 3), np.int16)
    for image in images:
        edges = np.sort(rng.choice(np.arange(1, 32), size=rng.integers(0, 4), replace=False))
        for x0, x1 in zip([0, *edges], [*edges, 32]):
            image[:, x0:x1] = rng.integers(0, 256, size=3)
        for _ in range(rng.integers(1, 3)):
            (y0, y1), (x0, x1) = (np.sort(rng.choice(33, size=2, replace=False)) for _ in "yx")
            image[y0:y1, x0:x1] = rng.integers(0, 256, size=3)
    images += rng.integers(-2, 3, size=images.shape, dtype=np.int16)
    return np.clip(images, 0, 255).astype(np.uint8)


IMAGES = {"noise": noise_images, "shapes": shapes_images}


def cifar_batch_file(rng, n, images="noise"):
    """Records of 1 label byte + 3,072 bytes (R plane, G plane, B plane, each 32x32 row-major);
    returns (file content, images as uint8 [n, 3072] in raster order (row, column, channel))."""
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    raster = IMAGES[images](rng, n)
    planes = raster.transpose(0, 3, 1, 2)
    raw = np.concatenate([labels[:, None], planes.reshape(n, -1)], axis=1).tobytes()
    return raw, raster.reshape(n, -1)


def write_archive(path, train_per_file, num_test, images="noise", seed=0):
    """cifar-10-binary.tar.gz at `path`; returns {TFDS example key: raster image}."""
    rng = np.random.default_rng(seed)
    members, expected = {}, {}
    for i in range(1, 6):
        raw, batch = cifar_batch_file(rng, train_per_file, images)
        members[f"data_batch_{i}.bin"] = raw
        for j, image in enumerate(batch):
            expected[f"train_{(i - 1) * train_per_file + j:05d}"] = image
    raw, batch = cifar_batch_file(rng, num_test, images)
    members["test_batch.bin"] = raw
    expected.update({f"test_{j:05d}": image for j, image in enumerate(batch)})
    members["batches.meta.txt"] = "\n".join(LABEL_NAMES + ["", ""]).encode()
    with tarfile.open(path, "w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return expected


def prepare(root, train_per_file, num_test, images="noise", seed=0):
    """Writes ROOT/manual/cifar-10-binary.tar.gz and prepares the real `cifar10` builder from it
    into ROOT/tfds; returns (data_dir, {TFDS example key: raster image})."""
    from tensorflow_datasets.core.download import checksums
    from tensorflow_datasets.image_classification import cifar as tfds_cifar

    from sparse_jax.data.cifar10 import CIFAR10_URL, prepare_cifar10

    manual = os.path.join(root, "manual")
    os.makedirs(manual, exist_ok=True)
    recorded = tfds_cifar.Cifar10.url_infos[CIFAR10_URL]  # the real record, before patching
    assert recorded.size == 170_052_171, "TFDS changed its CIFAR-10 record"
    archive = os.path.join(manual, recorded.filename)
    expected = write_archive(archive, train_per_file, num_test, images, seed)
    with open(archive, "rb") as f:
        content = f.read()
    tiny = checksums.UrlInfo(size=len(content), checksum=hashlib.sha256(content).hexdigest(),
                             filename=recorded.filename)
    data_dir = os.path.join(root, "tfds")
    with mock.patch.object(tfds_cifar.Cifar10, "url_infos", {CIFAR10_URL: tiny}):
        prepared = prepare_cifar10(data_dir, manual)
    assert any(name.startswith("cifar10-train.array_record") for name in os.listdir(prepared))
    return data_dir, expected


def main(argv):
    from absl import flags

    del argv
    f = flags.FLAGS
    if os.path.exists(os.path.join(f.root, "tfds")):
        sys.exit(f"{f.root}/tfds exists already; choose another --root")
    data_dir, expected = prepare(f.root, f.train_per_file, f.num_test, f.images, f.seed)
    print(f"{len(expected):,} images ({5 * f.train_per_file:,} train, {f.num_test:,} test) "
          f"prepared in {data_dir}: pass --config.data.data_dir={data_dir}")


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("root", None, "Folder for manual/ (the archive) and tfds/ (prepared).")
    flags.DEFINE_enum("images", "shapes", list(IMAGES), "What the images show.")
    flags.DEFINE_integer("train_per_file", 600, "Images per training file (5 files).")
    flags.DEFINE_integer("num_test", 500, "Test images.")
    flags.DEFINE_integer("seed", 0, "Generator seed.")
    flags.mark_flag_as_required("root")
    app.run(main)
