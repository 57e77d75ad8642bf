"""Folders of pictures (`sparse_jax.data.images`), written here with Pillow: H, W and C from the
pictures, train/ and test/ folders or a fixed-seed split (recorded, reproducible), the decoded
cache, one-line errors naming the file, train -> evaluate -> completion grid on a folder, and the
lossless baselines."""

import json
import os

import numpy as np
import pytest
from PIL import Image

from conftest import one_line_error, write_pictures
from sparse_jax import evaluate as E
from sparse_jax import sample as S
from sparse_jax import train
from sparse_jax.data import baselines, images
from sparse_jax.data import datasets as D
from test_train import get_config


def names(prefix, n, ext=".png"):
    return [f"{prefix}{i:03d}{ext}" for i in range(n)]


def no_decoding(monkeypatch):
    def decode(*args, **kwargs):
        raise AssertionError("decoded a picture")

    monkeypatch.setattr(images, "_decode", decode)


def tree(folder):
    """{relative path: bytes} of every file under `folder`: to show nothing was lost."""
    return {os.path.relpath(os.path.join(r, n), folder): open(os.path.join(r, n), "rb").read()
            for r, _, files in os.walk(folder) for n in files}


# ---------------------------------------------------------------------------------------------
# Pictures, shapes and splits.


@pytest.mark.parametrize("shape", [(6, 8, 3), (5, 4, 1), (3, 7, 4)])
def test_shape_comes_from_the_pictures_and_pixels_are_in_raster_order(tmp_path, shape):
    folder = tmp_path / "pics"
    written = write_pictures(folder, [f"cats/{n}" for n in names("c", 6)]
                             + [f"dogs/{n}" for n in names("d", 4)], shape)
    (folder / "notes.txt").write_text("not a picture")  # skipped, as are hidden files
    (folder / ".thumbnail.png").write_bytes(b"not read")
    loaded = images.load_folder(folder, (0.6, 0.2, 0.2))
    assert loaded.shape == shape and loaded.layout == "seeded" and loaded.decoded
    seen = {}
    for split in loaded.splits.values():
        got = split.images(np.arange(len(split)))
        assert got.dtype == np.uint8 and got.shape == (len(split), np.prod(shape))
        assert list(split.files) == sorted(split.files)  # name order within a split
        seen.update(zip(split.files, got))
    assert sorted(seen) == sorted(written)  # class subfolders are only folders
    for name, pixels in written.items():
        np.testing.assert_array_equal(seen[name], pixels.reshape(-1))  # row, column, channel
    n = int(np.prod(shape))
    ds = D.make_dataset({"name": "images", "path": str(folder), "split_fractions": (0.6, 0.2,
                                                                                   0.2)},
                        n, image_shape=shape, vocab_size=256)
    assert ds.unit == "dim" and ds.image_shape == shape and len(ds.splits["train"]) == 6
    batch = next(ds.train_batches(batch_size=2))
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert batch["targets"].shape == (2, n) and np.all(batch["inputs"][:, 0] == 0)
    assert ds.num_sequences("test") == 2


def test_jpeg_palette_and_cmyk_pictures_read_as_pillow_decodes_them(tmp_path):
    folder = tmp_path / "pics"
    write_pictures(folder, names("j", 3, ".jpg") + names("k", 2, ".JPEG"), (8, 8, 3))
    rgb = np.random.default_rng(1).integers(0, 256, (8, 8, 3), np.uint8)
    Image.fromarray(rgb).convert("P").save(folder / "palette.png")
    Image.fromarray(rgb).convert("CMYK").save(folder / "cmyk.jpg")
    loaded = images.load_folder(folder, (0.2, 0.4, 0.4))
    assert loaded.shape == (8, 8, 3)
    for split in loaded.splits.values():
        for name, got in zip(split.files, split.images(np.arange(len(split)))):
            want = np.asarray(Image.open(folder / name).convert("RGB"))
            np.testing.assert_array_equal(got, want.reshape(-1))


def test_train_and_test_folders_are_the_splits_and_valid_is_held_out_with_a_fixed_seed(tmp_path):
    folder = tmp_path / "pics"
    train_names = [f"train/{c}/{n}" for c in ("a", "b") for n in names(c, 25)]
    test_names = [f"test/{n}" for n in names("s", 7, ".jpg")]
    write_pictures(folder, train_names + test_names)
    loaded = images.load_folder(folder, (0.9, 0.1, 0.0))  # valid: 10% of train/, test: test/
    files = {s: list(split.files) for s, split in loaded.splits.items()}
    assert loaded.layout == "folders" and files["test"] == test_names
    perm = np.random.default_rng(images.SPLIT_SEED).permutation(50)
    assert files["valid"] == sorted(np.array(train_names)[perm[45:]])
    assert files["train"] == sorted(np.array(train_names)[perm[:45]])
    again = images.load_folder(folder, (0.9, 0.1, 0.0))
    assert not again.decoded and {s: list(x.files) for s, x in again.splits.items()} == files
    with open(os.path.join(loaded.cache, "split.json")) as f:
        record = json.load(f)
    assert record["splits"] == files and record["split_seed"] == images.SPLIT_SEED
    assert record["layout"] == "folders" and record["shape"] == [6, 8, 3]
    fingerprint = images.fingerprint(loaded)
    assert fingerprint["num_images"] == {"train": 45, "valid": 5, "test": 7}
    assert fingerprint["layout"] == "folders" and fingerprint["size"] == 57
    # A valid/ folder is the valid split as it is.
    valid_names = [f"valid/{n}" for n in names("v", 3)]
    write_pictures(folder, valid_names, seed=1)
    loaded = images.load_folder(folder, (0.9, 0.1, 0.0))
    assert loaded.decoded and list(loaded.splits["valid"].files) == valid_names
    assert list(loaded.splits["train"].files) == train_names


def test_without_split_folders_a_fixed_seed_split_is_recorded_and_reproducible(tmp_path):
    folder = tmp_path / "pics"
    all_names = [f"{c}/{n}" for c in ("x", "y") for n in names(c, 20)]
    write_pictures(folder, all_names)
    config = {"name": "images", "path": str(folder), "split_fractions": (0.5, 0.25, 0.25)}
    ds = D.make_dataset(config, 144)
    files = {s: list(split.files) for s, split in ds.splits.items()}
    perm = np.random.default_rng(images.SPLIT_SEED).permutation(40)
    assert files["test"] == sorted(np.array(all_names)[perm[30:]])
    assert sorted(sum(files.values(), [])) == all_names  # disjoint, covering every picture
    other_seed = D.make_dataset({**config, "seed": 3}, 144)  # the run's seed: order, not split
    assert {s: list(x.files) for s, x in other_seed.splits.items()} == files
    with open(os.path.join(images.cache_dir(folder), "split.json")) as f:
        assert json.load(f)["splits"] == files
    recorded = json.loads(json.dumps(D.fingerprint(config, ds)))
    assert recorded["split_seed"] == images.SPLIT_SEED and recorded["layout"] == "seeded"
    assert recorded["num_images"] == {"train": 20, "valid": 10, "test": 10}
    assert D.check_fingerprint(recorded, config) == recorded
    moved = tmp_path / "moved"
    os.rename(folder, moved)  # the same pictures elsewhere: the same data
    D.check_fingerprint(recorded, {**config, "path": str(moved)})
    one_line_error(ValueError, lambda: D.check_fingerprint(  # another split of them: not
        recorded, {**config, "path": str(moved), "split_fractions": (0.6, 0.2, 0.2)}),
        f"the pictures in {moved}", "not the data this run started with", "--workdir")


def test_the_second_load_maps_the_cache_and_a_changed_folder_is_decoded_again(tmp_path,
                                                                               monkeypatch):
    folder = tmp_path / "pics"
    write_pictures(folder, [f"a/{n}" for n in names("p", 6)])
    config = {"name": "images", "path": str(folder), "split_fractions": (0.5, 0.25, 0.25)}
    first = images.load_folder(folder, (0.5, 0.25, 0.25))
    assert first.decoded and sorted(os.listdir(first.cache)) == [
        "pixels.npy", "pixels.npy.verified", "split.json"]  # no temporary file left
    pixels = first.splits["train"].images(range(3))
    recorded = D.fingerprint(config)
    no_decoding(monkeypatch)
    second = images.load_folder(folder, (0.5, 0.25, 0.25))
    assert not second.decoded and isinstance(second.splits["train"].pixels, np.memmap)
    np.testing.assert_array_equal(second.splits["train"].images(range(3)), pixels)
    os.utime(folder / "a/p003.png", ns=(1, 1))  # a picture changed (its mtime says so)
    with pytest.raises(AssertionError, match="decoded a picture"):
        images.load_folder(folder, (0.5, 0.25, 0.25))
    write_pictures(folder, ["a/p003.png"], seed=9)  # and now its pixels too
    monkeypatch.undo()
    assert images.load_folder(folder, (0.5, 0.25, 0.25)).decoded
    one_line_error(ValueError, lambda: D.check_fingerprint(recorded, config),
                   f"the pictures in {folder} changed since this run started", "--workdir")
    os.remove(folder / "a/p005.png")  # a picture removed, another added: decoded again
    write_pictures(folder, ["b/new.png"], seed=3)
    again = images.load_folder(folder, (0.5, 0.25, 0.25))
    assert again.decoded and "b/new.png" in sum((x.files for x in again.splits.values()), ())
    # A file at the cache's path that sparse_jax did not write is never replaced.
    cache = images.cache_dir(folder)
    os.remove(os.path.join(cache, "pixels.npy.verified"))
    with open(os.path.join(cache, "pixels.npy"), "wb") as f:
        f.write(b"my own array")
    one_line_error(ValueError, lambda: images.load_folder(folder), "pixels.npy",
                   "not written by sparse_jax", "move it away")
    assert open(os.path.join(cache, "pixels.npy"), "rb").read() == b"my own array"


# ---------------------------------------------------------------------------------------------
# Bad folders: one line naming the file and the fix, before anything is decoded.


def _sixteen_bit(folder):
    write_pictures(folder, names("ok", 2))
    Image.fromarray(np.zeros((6, 8), np.uint16)).save(folder / "deep.png")  # mode I;16
    return folder / "deep.png"


def _truncated_jpeg(folder):
    write_pictures(folder, names("ok", 2, ".jpg"))
    content = (folder / "ok001.jpg").read_bytes()
    (folder / "ok001.jpg").write_bytes(content[:-40])  # the header whole, the pixels cut
    return folder / "ok001.jpg"


def _bad(case, folder):
    """Writes the bad folder of `case`; returns (path to load, error type, needles)."""
    folder.mkdir()
    if case == "missing folder":
        return folder / "nope", FileNotFoundError, [folder / "nope", "--config.data.path"]
    if case == "a file, not a folder":
        write_pictures(folder, ["one.png"])
        return folder / "one.png", NotADirectoryError, [folder / "one.png", "is a file"]
    if case == "no pictures":
        (folder / "sub").mkdir()
        (folder / "sub" / "notes.txt").write_text("hello")
        return folder, ValueError, [folder, "no PNG or JPEG pictures", "1 other files",
                                    "--config.data.path"]
    if case == "mixed sizes":
        write_pictures(folder, ["a/1.png", "a/2.png"])
        write_pictures(folder, ["b/3.png"], shape=(7, 8, 3))
        return folder, ValueError, [folder / "b/3.png", "8x7", "differ in size", "resize"]
    if case == "grayscale among RGB":
        write_pictures(folder, ["a/1.jpg", "a/2.jpg"])
        write_pictures(folder, ["a/3.jpg"], shape=(6, 8, 1))
        return folder, ValueError, [folder / "a/3.jpg", "grayscale", "among RGB", "convert('RGB')"]
    if case == "not a picture":
        write_pictures(folder, ["a/1.png"])
        (folder / "a" / "2.png").write_bytes(b"<html>404 Not Found</html>")
        return folder, ValueError, [folder / "a/2.png", "not a readable PNG or JPEG", "move it out"]
    if case == "16-bit picture":
        return folder, ValueError, [_sixteen_bit(folder), "mode I;16", "8-bit"]
    if case == "train/ without test/":
        write_pictures(folder, ["train/1.png"])
        return folder, ValueError, [folder, "has a train/ folder but no test/", "rename train/"]
    if case == "a picture outside train/ and test/":
        write_pictures(folder, ["train/1.png", "test/2.png", "extra/3.png"])
        return folder, ValueError, [folder / "extra/3.png", "lies outside", "move it"]
    if case == "empty test/":
        write_pictures(folder, ["train/1.png"])
        (folder / "test").mkdir()
        return folder, ValueError, [folder / "test", "no PNG or JPEG pictures", "add some"]
    assert case == "damaged past its header"  # found while decoding: no cache is written
    return folder, ValueError, [_truncated_jpeg(folder), "is damaged", "cannot be decoded"]


@pytest.mark.parametrize("case", [
    "missing folder", "a file, not a folder", "no pictures", "mixed sizes", "grayscale among RGB",
    "not a picture", "16-bit picture", "train/ without test/",
    "a picture outside train/ and test/", "empty test/", "damaged past its header"])
def test_a_bad_folder_is_one_line_naming_the_file_and_the_fix(tmp_path, monkeypatch, case):
    path, error, needles = _bad(case, tmp_path / "pics")
    before = tree(tmp_path)
    if case != "damaged past its header":
        no_decoding(monkeypatch)  # refused from the listing and the headers alone
    config = {"name": "images", "path": str(path)}
    one_line_error(error, lambda: D.make_dataset(config, 144, image_shape=(6, 8, 3)), *needles)
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if "pixels.npy" not in k} == before
    assert not [k for k in after if k.endswith("pixels.npy")]  # no cache of a bad folder


def test_a_picture_name_that_is_not_a_regular_file_is_one_line_without_blocking(tmp_path):
    """A FIFO named like a picture (opening it with no writer would wait forever) is refused
    from the folder's listing, in one line that says what it is; nothing is written."""
    import threading

    folder = tmp_path / "pics"
    write_pictures(folder, ["a/1.png"])
    os.mkfifo(folder / "a" / "2.png")
    config = {"name": "images", "path": str(folder)}
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(pytest.raises(
        ValueError, lambda: D.make_dataset(config, 144, image_shape=(6, 8, 3)))), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert outcome, "blocked on the FIFO"
    message = str(outcome[0].value)
    assert message == f"{folder / 'a' / '2.png'} is a pipe (FIFO), not a picture file; move it " \
                      f"out of {folder}, or save the picture it stands for as a file", message
    assert sorted(os.listdir(folder / "a")) == ["1.png", "2.png"] and os.listdir(folder) == ["a"]


def test_a_model_of_another_shape_is_refused_before_decoding(tmp_path, monkeypatch):
    folder = tmp_path / "pics"
    write_pictures(folder, names("p", 4))
    no_decoding(monkeypatch)
    config = {"name": "images", "path": str(folder), "split_fractions": (0.5, 0.25, 0.25)}
    fix = ["6 x 8 x 3", "--config.model.seq_len=144", "--config.model.image_shape=(6,8,3)",
           "--config.model.stride=24", f"the pictures in {folder}"]
    one_line_error(ValueError, lambda: D.make_dataset(config, 3072), "seq_len=3072", *fix)
    one_line_error(ValueError, lambda: D.make_dataset(config, 144, image_shape=(8, 6, 3)),
                   "image_shape=(8, 6, 3)", *fix)  # as many sub-pixels, another shape
    with pytest.raises(ValueError, match="needs a folder of pictures"):
        D.data_config({"name": "images"})


# ---------------------------------------------------------------------------------------------
# The whole path on a folder: train a few steps, bits/dim, the completion grid, the baselines.


TINY_PICTURES = dict(model__image_shape=(8, 8, 3), model__seq_len=192, model__stride=24,
                     model__d_model=16, total_steps=3, eval_every=3, checkpoint_every=3,
                     data__split_fractions=(0.75, 0.25, 0.0))  # valid: 3 of the 12 in train/


def test_the_picture_preset_takes_its_shape_from_the_folder(tmp_path, capsys):
    """configs/images.py on 8 x 8 pictures with no model override: image_shape, seq_len,
    stride and c come from the pictures, and the first line says so; an override is kept."""
    folder = tmp_path / "pics"
    write_pictures(folder, [f"train/{n}" for n in names("t", 50)] + [f"test/{n}" for n in
                                                                      names("s", 2)], (8, 8, 3))
    config = get_config("images", "size=tiny", data__path=str(folder))  # only the folder
    result = train.train(config, str(tmp_path / "run"))
    assert result["step"] == 4 and 0 < result["valid_bits"] < 9
    first = capsys.readouterr().out.splitlines()[0]
    assert "pictures of 8x8x3" in first and "model.seq_len=192" in first, first
    m = config.model
    assert (tuple(m.image_shape), m.seq_len, m.stride, m.c) == ((8, 8, 3), 192, 24, 6)
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert tuple(recorded["image_shape"]) == (8, 8, 3) and recorded["seq_len"] == 192
    chosen = get_config("images", "size=tiny", data__path=str(folder), model__stride=12)
    assert "model.stride" not in images.fill_model_shape(chosen) and chosen.model.stride == 12
    with pytest.raises(ValueError, match="data.path=FOLDER"):
        images.fill_model_shape(get_config("images", "size=tiny"))


def test_a_shape_override_the_folder_contradicts_is_refused_unannounced_and_leaves_no_workdir(
        tmp_path, capsys):
    """configs/images.py on 8 x 8 pictures with --config.model.image_shape=(16,16,3): one error
    naming the pictures' shape and the fix, no line announcing 16x16x3 first, and no workdir
    left behind; a model whose every field is set is refused by the data check under the
    workdir's lock, which leaves nothing either (a folder it found stays, empty)."""
    folder = tmp_path / "pics"
    write_pictures(folder, names("p", 8), (8, 8, 3))
    run = tmp_path / "new" / "run"
    config = get_config("images", "size=tiny", data__path=str(folder),
                        model__image_shape=(16, 16, 3))
    with pytest.raises(ValueError) as e:
        train.train(config, str(run))
    message = str(e.value)
    assert "are 8 x 8 x 3" in message and "image_shape=(16, 16, 3)" in message
    assert "leave --config.model.image_shape out" in message and "(8,8,3)" in message
    assert "pictures of" not in capsys.readouterr().out
    assert not (tmp_path / "new").exists()
    config = get_config("images", "size=tiny", data__path=str(folder), model__image_shape=(
        16, 16, 3), model__seq_len=768, model__stride=48, model__c=12)  # all set: the data's check
    with pytest.raises(ValueError, match="are 8 x 8 x 3"):
        train.train(config, str(run))
    assert not (tmp_path / "new").exists()
    run.mkdir(parents=True)
    with pytest.raises(ValueError, match="are 8 x 8 x 3"):
        train.train(config, str(run))
    assert os.listdir(run) == []  # no .lock, no data_fingerprint.json


def test_train_evaluate_and_complete_pictures_of_a_folder(tmp_path):
    folder = tmp_path / "pics"
    write_pictures(folder, [f"train/{n}" for n in names("t", 12)] + [f"test/{n}" for n in
                                                                      names("s", 5)], (8, 8, 3))
    config = get_config("images", "size=tiny", data__path=str(folder), **TINY_PICTURES)
    workdir = str(tmp_path / "run")
    result = train.train(config, workdir)
    assert result["step"] == 3 and 0 < result["valid_bits"] < 9
    scored = E.evaluate(workdir, "test", progress=False)
    assert scored["unit"] == "dim" and scored["num_scored"] == 5 * 192
    assert 0 < scored["bits"] < 9 and "bits/dim" in E.format_table(scored)
    done = S.sample(workdir, complete=3, seed=2)
    test = images.load_folder(folder, config.data.split_fractions).splits["test"]
    assert list(done["picked"]) == [0, 2, 4]  # spread over the split, first and last included
    originals = test.images(done["picked"]).reshape(3, 8, 8, 3)
    np.testing.assert_array_equal(done["samples"][:, :4], originals[:, :4])  # the top halves
    assert done["path"].endswith("3_complete_test_seed2.png")
    zoom = S.completion_zoom(8, 8)
    grid = np.asarray(Image.open(done["path"]))  # rows: originals, top halves shown, completions
    assert zoom == 12 and grid.shape == (zoom * (3 * 10 + 2), zoom * (3 * 10 + 2), 3)
    tile = lambda r, c: grid[zoom * (2 + 10 * r):][:8 * zoom:zoom, zoom * (2 + 10 * c):][  # noqa
        :, :8 * zoom:zoom]
    for c in range(3):
        np.testing.assert_array_equal(tile(0, c), originals[c])
        np.testing.assert_array_equal(tile(1, c)[:4], originals[c, :4])
        assert np.all(tile(1, c)[4:] == S.HIDDEN)
        np.testing.assert_array_equal(tile(2, c), done["samples"][c])
    with pytest.raises(ValueError, match="exceeds the 5 test images"):
        S.sample(workdir, complete=6)


def test_lossless_baselines_in_bits_per_dim(tmp_path):
    folder = tmp_path / "pics"
    flat = np.zeros((6, 8, 3), np.uint8)
    write_pictures(folder, [f"train/{n}" for n in names("t", 4)] + [f"test/{n}" for n in
                                                                     names("s", 3)])
    Image.fromarray(flat).save(folder / "test" / "flat.png")  # compresses far better than noise
    result = baselines.baselines(str(folder), split="test")
    assert result["num_images"] == 4 and result["subpixels"] == 4 * 144
    for codec in ("png", "webp"):
        row = result["codecs"][codec]
        assert row["bits_per_dim"] == pytest.approx(8 * row["bytes"] / (4 * 144))
        assert 0 < row["bits_per_dim"] and row["lossless"]
    one = baselines.baselines(str(folder), split="test", limit=1)  # the first picture: flat
    assert one["num_images"] == 1
    for codec in ("png", "webp"):  # a flat picture costs little more than the file's headers
        assert one["codecs"][codec]["bytes"] * 2 < result["codecs"][codec]["bytes"] / 4
    table = baselines.format_table(result)
    assert "PNG" in table and "WebP" in table and "bits/dim" in table


def test_repeat_reach_sees_a_copy_only_from_a_context_that_reaches_it():
    """Random bytes, then the same bytes again 1,000 later: every position of the copy past its
    first k is a repeat whose next byte is copied, within 1,000 bytes but not within 512."""
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, 1000, dtype=np.uint8)
    data = np.concatenate([block, block])
    reach = baselines.repeat_reach(data, [512, 1000, 0], k=12)
    share = (1000 - 12) / (2000 - 12)
    assert reach[512] == {"seen": 0.0, "copied": 0.0}
    assert reach[1000]["seen"] == reach[1000]["copied"] == pytest.approx(share)
    assert reach[0] == reach[1000]
    data[1500] ^= 1  # a changed byte: not copied, and the 12 after it are no repeats
    reach = baselines.repeat_reach(data, [1000], k=12)[1000]
    assert reach["seen"] == pytest.approx((1000 - 12 - 12) / (2000 - 12))
    assert reach["copied"] == pytest.approx(reach["seen"] - 1 / (2000 - 12))
