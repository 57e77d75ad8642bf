"""Evaluation of a checkpoint: bits/byte equals a hand-computed NLL, every byte scored once with
and without min_context, checkpoint choice, bits/dim of images, the script, and bad input."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from sparse_jax import evaluate as E
from sparse_jax import train
from sparse_jax.data import baselines as B
from sparse_jax.data import cifar10, sources
from sparse_jax.data import datasets as D
from sparse_jax.data.batches import eval_windows, read_windows
from sparse_jax.model.config import model_config
from sparse_jax.model.transformer import SparseTransformer
from sparse_jax.run import checkpoints, optim
from sparse_jax.run import config as config_lib
from test_train import ROOT, TINY_TEXT, get_config  # noqa: F401  (also used by test_sample)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A real 4-step training run (checkpoints at steps 2 and 4, both with valid bits)."""
    workdir = str(tmp_path_factory.mktemp("eval") / "run")
    train.train(get_config("quickstart", "data=embedded", **TINY_TEXT), workdir)
    return workdir


def hand_nll(workdir, split, step, min_context, data_path=None):
    """(bits [windows, n], scored mask [windows, n], split size) from the model's logits with a
    float64 NumPy log-softmax, window by window (on the byte file `data_path` if given)."""
    model, config, _ = checkpoints.restore_model(workdir, step)
    n = model.cfg.seq_len
    if data_path:
        config.data.name, config.data.path = "bytes", data_path
    data = D.make_dataset(config.data, n).splits[split]
    windows = eval_windows(data, n, min_context)
    rows = read_windows(data, windows.starts, n)
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, rows["inputs"]), np.float64)
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, rows["targets"][..., None], -1)[..., 0]
    j = np.arange(n)[None]
    mask = (j >= windows.score_from[:, None]) & (j < windows.score_to[:, None])
    return nll / np.log(2), mask, len(data)


def hand_bits(workdir, split, step, min_context, data_path=None):
    """Bits per byte by hand (`hand_nll`), the number of scored bytes and the split size."""
    bits, mask, size = hand_nll(workdir, split, step, min_context, data_path)
    return bits[mask].sum() / mask.sum(), int(mask.sum()), size


@pytest.mark.parametrize("min_context, batch_size", [(None, None), (None, 3), (48, 5), (1, 16)])
def test_bits_per_byte_equal_hand_computed_nll_and_score_every_byte_once(
        text_run, min_context, batch_size):
    result = E.evaluate(text_run, "test", "latest", min_context, batch_size, progress=False,
                        overwrite=True)  # the cases with the same min_context share a file
    expected, scored, size = hand_bits(text_run, "test", 4, min_context)
    assert result["num_scored"] == scored == size - 1  # every byte but the first, exactly once
    assert result["bits"] == pytest.approx(expected, rel=1e-5)
    assert result["unit"] == "byte" and result["step"] == 4 and result["split"] == "test"
    assert result["min_context"] == min_context
    assert result["tokens_per_s"] > 0 and result["wall_s"] > 0
    name = "test_4" + (f"_minctx{min_context}" if min_context else "") + ".json"
    assert result["path"] == os.path.join(text_run, "eval", name)
    with open(result["path"]) as f:
        saved = json.load(f)
    assert {k: saved[k] for k in ("split", "step", "bits", "unit", "num_scored", "min_context")} \
        == {k: result[k] for k in ("split", "step", "bits", "unit", "num_scored", "min_context")}


def test_position_edges():
    assert E.position_edges(4096) == [0, 64, 128, 256, 512, 1024, 2048, 4096]
    assert E.position_edges(3072) == [0, 64, 128, 256, 512, 1024, 2048, 3072]
    assert E.position_edges(512) == [0, 64, 128, 256, 512]
    assert E.position_edges(128) == [0, 64, 128] and E.position_edges(64) == [0, 32, 64]
    assert E.position_edges(1) == [0, 1]
    for n in (1, 7, 64, 1000, 4096):
        fine = E.position_edges(n, 4)
        assert fine[0] == 0 and fine[-1] == n and all(np.diff(fine) > 0)
    assert E.position_edges(4096, 4)[:10] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10]


@pytest.mark.parametrize("min_context", [None, 40])
def test_bits_by_position_average_to_the_bits_and_equal_hand_computed(text_run, min_context):
    """Every bucket equals the hand-computed bits of its positions, and the buckets, weighted by
    their counts, give the overall bits exactly (float64 sums on the host)."""
    result = E.evaluate(text_run, "valid", 4, min_context, 3, progress=False, overwrite=True)
    bits, mask, _ = hand_nll(text_run, "valid", 4, min_context)
    for key, edges in [("by_position", [0, 32, 64]), ("position_curve", E.position_edges(64, 4))]:
        buckets = result[key]
        assert [(b["first"], b["last"] + 1) for b in buckets] == list(zip(edges, edges[1:]))
        assert sum(b["count"] for b in buckets) == result["num_scored"]
        total = sum(b["bits"] * b["count"] for b in buckets if b["count"])
        assert total / result["num_scored"] == pytest.approx(result["bits"], rel=1e-12)
        for b in buckets:
            part = mask[:, b["first"]:b["last"] + 1]
            assert b["count"] == part.sum()
            assert b["bits"] == pytest.approx(
                bits[:, b["first"]:b["last"] + 1][part].mean(), rel=1e-5)
    png = result["path"][:-len(".json")] + ".png"
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_late_positions_score_lower_where_the_bytes_repeat_far_back(tmp_path):
    """In the generated stream, 3 rows in 4 repeat the row 128 bytes back
    (`sources.embedded_bytes`). A model trained briefly on it, with the strided part reaching
    exactly that far (stride 127), predicts the repeats only where the window holds their
    source: positions 127 and on score far below positions 0-63. Trained by scripts/train.py:
    its 300 steps compile as users' do, and run twice as fast as in this process, whose cheap
    compile (conftest.py) suits tests that compile much and run little."""
    overrides = dict(data__embedded_bytes=2**17, model__seq_len=254, model__num_layers=1,
                     model__d_model=32, batch_size=8, total_steps=300, eval_every=300,
                     checkpoint_every=300, log_every=100, eval_batches=2,
                     optimizer__warmup_steps=10, optimizer__lr=1e-2)
    workdir = str(tmp_path / "run")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
         f"--config={os.path.join(ROOT, 'configs', 'quickstart.py')}:data=embedded",
         f"--workdir={workdir}",
         *(f"--config.{k.replace('__', '.')}={v}" for k, v in overrides.items())],
        cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert config_lib.read_record(workdir).to_dict() == get_config(
        "quickstart", "data=embedded", **overrides).to_dict()  # the run it trained
    result = E.evaluate(workdir, "valid", progress=False, write=False)
    early, _, late = result["by_position"]
    assert (early["first"], early["last"], late["first"], late["last"]) == (0, 63, 128, 253)
    assert late["bits"] < early["bits"] - 1.0, result["by_position"]  # measured: 1.1 and 3.2


def test_checkpoint_choice(text_run):
    with open(os.path.join(text_run, "metrics.jsonl")) as f:
        valid = {r["step"]: r["bits"] for r in map(json.loads, f) if r["split"] == "valid"}
    best = min(valid, key=valid.get)
    results = {c: E.evaluate(text_run, "valid", c, progress=False, write=False)
               for c in ("latest", "best", 2, "2")}
    assert results["latest"]["step"] == 4 and results["best"]["step"] == best
    assert results[2]["step"] == results["2"]["step"] == 2
    assert results[2]["bits"] != results["latest"]["bits"]
    # The trainer scored at most eval_batches of the valid split; here the whole split counts.
    assert results["latest"]["num_scored"] == len(
        D.make_dataset(config_lib.read_record(text_run).data, 64).splits["valid"]) - 1


def test_bad_input_fails_before_any_expensive_work(text_run, tmp_path, monkeypatch):
    def expensive(*args, **kwargs):
        raise AssertionError("checks must come before restoring parameters")

    monkeypatch.setattr(checkpoints, "restore_model", expensive)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        E.evaluate(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        E.evaluate(str(tmp_path))
    (tmp_path / "config.json").write_text(config_lib.read_record(text_run).to_json())
    with pytest.raises(FileNotFoundError, match="no checkpoints"):
        E.evaluate(str(tmp_path))
    for kwargs, message in [(dict(checkpoint="last"), "latest"),
                            (dict(checkpoint=-1), "step number"),
                            (dict(split="dev"), "split"), (dict(min_context=64), "min_context"),
                            (dict(min_context=-1), "min_context"), (dict(batch_size=0), "batch"),
                            (dict(batch_size=2.5), "batch")]:
        with pytest.raises(ValueError, match=message):
            E.evaluate(text_run, **kwargs)
    with pytest.raises(FileNotFoundError, match="other.txt not found: set --data"):
        E.evaluate(text_run, data_path=str(tmp_path / "other.txt"))
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 3 .*steps: \[2, 4\]"):
        E.evaluate(text_run, checkpoint=3)


def test_another_file_is_scored_as_by_hand_and_written_apart(text_run, tmp_path):
    """data_path (--data): the run's model scores another byte file's split exactly as by hand,
    without the run's data record (another file has another fingerprint), and the result goes
    to eval/<file name>/, leaving the run's own results as they were."""
    other = tmp_path / "other.txt"
    other.write_bytes(sources.embedded_bytes(20_000, seed=7).tobytes())
    own = E.evaluate(text_run, "valid", progress=False, overwrite=True)
    before = open(own["path"], "rb").read()
    result = E.evaluate(text_run, "valid", data_path=str(other), progress=False)
    expected, scored, size = hand_bits(text_run, "valid", 4, None, str(other))
    assert result["path"] == os.path.join(text_run, "eval", "other.txt", "valid_4.json")
    assert result["data_path"] == str(other) and result["split_size"] == size == 1000
    assert (own["dataset"], result["dataset"]) == ("embedded", "bytes")
    assert result["num_scored"] == scored and result["bits"] == pytest.approx(expected, rel=1e-5)
    assert result["bits"] != pytest.approx(own["bits"], abs=1e-3)  # another file was read
    assert open(own["path"], "rb").read() == before
    assert json.load(open(result["path"]))["bits"] == result["bits"]
    with pytest.raises(FileExistsError):  # like any result: replaced only with overwrite
        E.evaluate(text_run, "valid", data_path=str(other), progress=False)


def test_another_file_that_cannot_be_scored_says_what_evaluate_can_do_and_leaves_no_folder(
        text_run, tmp_path, monkeypatch):
    """--data with an empty file, a folder (of pictures or anything), a FIFO with no writer or
    a device (not regular files: refused unopened, without blocking), a file too short for the
    split, or a user's damaged .gz: one line naming --data (evaluate has no --config) and what
    is possible for a trained model (a longer file, another --split, the uncompressed file),
    before any parameters are restored, and no eval/<name>/ folder left behind."""
    def expensive(*args, **kwargs):
        raise AssertionError("checks must come before restoring parameters")

    monkeypatch.setattr(checkpoints, "restore_model", expensive)
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "pics").mkdir()
    (tmp_path / "ten.txt").write_bytes(b"0123456789")
    (tmp_path / "mine.txt.gz").write_bytes(b"not gzip at all")
    os.mkfifo(tmp_path / "fifo")  # no writer: opening it would wait forever
    for name, error, parts in [
            ("fifo", OSError, ["fifo is a pipe (FIFO), not a regular file", "set --data=FILE"]),
            ("/dev/zero", OSError, ["/dev/zero is a character device, not a regular file"]),
            ("empty.txt", ValueError, ["empty.txt is empty", "set --data to a file with data"]),
            ("pics", IsADirectoryError, ["pics is a folder", "a model of bytes reads a file",
                                         "set --data to a file"]),
            ("ten.txt", ValueError, ["the test split", "has 0 bytes", "give --data a longer file",
                                     "--split=train (9 bytes)"]),
            ("mine.txt.gz", ValueError, ["mine.txt.gz is damaged or not a gzip file",
                                         "gzip -f FILE (not -k", "set --data=FILE.gz",
                                         "set --data to the uncompressed file"])]:
        with pytest.raises(error) as e:
            E.evaluate(text_run, data_path=str(tmp_path / name))
        message = str(e.value)
        assert "\n" not in message and all(p in message for p in parts), message
        assert "--config" not in message and "git checkout" not in message, message
        assert not os.path.exists(os.path.join(text_run, "eval", os.path.basename(name))), name
    assert sorted(os.listdir(tmp_path)) == ["empty.txt", "fifo", "mine.txt.gz", "pics",
                                            "ten.txt"]
    with pytest.raises(ValueError, match=r"--data=.*ten\.txt: only a model of bytes"):
        config = config_lib.read_record(text_run)  # a run of another vocabulary
        config.model.vocab_size = 128
        workdir = tmp_path / "run"
        shutil.copytree(text_run, workdir)
        config_lib.write_record(str(workdir), config)
        E.evaluate(str(workdir), data_path=str(tmp_path / "ten.txt"))


@pytest.mark.slow  # starts other processes
def test_damaged_newest_checkpoint_falls_back_and_is_never_touched(text_run, tmp_path, capsys):
    workdir = str(tmp_path / "run")
    shutil.copytree(text_run, workdir)
    shutil.rmtree(os.path.join(workdir, "eval"), ignore_errors=True)
    params = os.path.join(workdir, "checkpoints", "4", "params")
    victims = [os.path.join(d, n) for d, _, names in os.walk(params) for n in names]
    for path in victims:  # every file of the newest parameters cut short
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    before = {p: open(p, "rb").read() for p in victims}
    result = E.evaluate(workdir, "valid", progress=False)
    assert result["step"] == 2 and "warning: checkpoint 4" in capsys.readouterr().err
    with pytest.raises(OSError, match=r"checkpoint 4 in .* cannot be read .*--checkpoint") as e:
        E.evaluate(workdir, "valid", checkpoint=4, progress=False)
    assert "\n" not in str(e.value)
    assert {p: open(p, "rb").read() for p in victims} == before  # read-only: nothing moved
    with pytest.raises(FileExistsError, match="valid_2.json exists"):  # results are kept
        E.evaluate(workdir, "valid", progress=False)


def test_a_checkpoint_removed_while_listed_sends_the_reader_back_to_a_fresh_listing(
        text_run, monkeypatch):
    """Beside a saving run, the run's rotation may remove a checkpoint while a reader lists them
    (Orbax read its name, then its folder was gone: FileNotFoundError): every other listing here
    fails so; the reader lists again and restores the newest checkpoint."""
    import orbax.checkpoint as ocp

    real, listings = ocp.CheckpointManager._load_checkpoint_infos, []

    def vanishing(self, *args, **kwargs):
        listings.append(self.directory)
        if len(listings) % 2:
            raise FileNotFoundError(2, "No such file or directory", f"{self.directory}/4")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "_load_checkpoint_infos", vanishing)
    assert checkpoints.restore_model(text_run)[2] == 4
    assert len(listings) == 4  # the manager's and the restore's listing, each done twice


def test_script_prints_a_table_and_writes_json(text_run):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    script = os.path.join(ROOT, "scripts", "evaluate.py")
    proc = subprocess.run([sys.executable, script, f"--workdir={text_run}", "--split=valid",
                           "--checkpoint=2", "--min_context=32", "--batch_size=8"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| valid | 2 |" in proc.stdout and "bits/byte" in proc.stdout
    assert "| 0–31 |" in proc.stdout and "| 32–63 |" in proc.stdout  # by position
    assert "| copy 1-512 back |" in proc.stdout and "| rest (no copy within 4,096) |" \
        in proc.stdout  # by copy class
    path = os.path.join(text_run, "eval", "valid_2_minctx32.json")
    assert f"Wrote {path}" in proc.stdout and os.path.exists(path)
    bad = subprocess.run([sys.executable, script, f"--workdir={text_run}", "--checkpoint=9"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "no checkpoint of step 9" in bad.stderr


def save_like_train(config, workdir, step=1):
    """A randomly initialized checkpoint written with the trainer's own checkpoint functions."""
    os.makedirs(workdir)
    config_lib.write_record(workdir, config)
    model = SparseTransformer(model_config(config.model), rngs=nnx.Rngs(config.seed))
    optimizer = nnx.Optimizer(model, optim.make_optimizer(config)[0], wrt=nnx.Param)
    manager = checkpoints.manager(workdir, keep=2)
    meta = checkpoints.Meta(step=step, data={"seed": 0, "step": step}, rng=[0, 0], window={},
                            best_valid_bits=None)
    checkpoints.save(manager, step, {"params": nnx.state(model), "opt": nnx.state(optimizer)},
                     meta, None)
    checkpoints.wait(manager, step)
    manager.close()
    return model


def test_images_bits_per_dim_over_every_sub_pixel(cifar, tmp_path, monkeypatch):
    data_dir, expected = cifar
    monkeypatch.setattr(cifar10, "CIFAR10_VALID_SIZE", 4)  # of the 20 images of the tiny archive
    config = get_config("cifar10", "size=tiny", data__data_dir=data_dir, model__d_model=8,
                        model__num_heads=1)
    workdir = str(tmp_path / "run")
    model = save_like_train(config, workdir)
    result = E.evaluate(workdir, "test", batch_size=2, progress=False)
    images = np.stack([expected[f"test_{i:05d}"] for i in range(5)]).astype(np.int32)
    inputs = np.concatenate([np.zeros((5, 1), np.int32), images[:, :-1]], axis=1)
    logits = np.asarray(jax.jit(lambda x: model(x))(inputs), np.float64)
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, images[..., None], -1)
    assert result["unit"] == "dim" and result["num_scored"] == 5 * 3072
    assert "copy_classes" not in result  # byte classes are for byte streams
    assert result["bits"] == pytest.approx(nll.mean() / np.log(2), rel=1e-5)
    with pytest.raises(ValueError, match="byte data only"):
        E.evaluate(workdir, "test", min_context=10)
    with pytest.raises(ValueError, match="only a model of bytes"):
        E.evaluate(workdir, "test", data_path=str(tmp_path / "run" / "config.json"))


def test_plot_positions_script_draws_several_results_and_refuses_other_files(text_run, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    script = os.path.join(ROOT, "scripts", "plot_positions.py")
    results = [E.evaluate(text_run, "valid", step, progress=False, overwrite=True)["path"]
               for step in (2, 4)]
    out = str(tmp_path / "both.png")
    proc = subprocess.run([sys.executable, script, f"--output={out}", "--label=step 2, early",
                           "--label=step 4", *results], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    again = subprocess.run([sys.executable, script, f"--output={out}", *results],
                           capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 2 and "exists; pass --overwrite" in again.stderr  # not replaced
    bad = subprocess.run([sys.executable, script, f"--output={out}", "--overwrite",
                          os.path.join(text_run, "config.json")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1 and "no bits by position" in bad.stderr


def reference_last_repeat(data, k):
    """`baselines.last_repeat` as a plain loop with a dict of last occurrences."""
    data, last = bytes(np.asarray(data, np.uint8)), {}
    distance, copied = np.zeros(len(data), np.int64), np.zeros(len(data), bool)
    for i in range(k, len(data)):
        j, last[data[i - k:i]] = last.get(data[i - k:i]), i
        if j is not None:
            distance[i], copied[i] = i - j, data[j] == data[i]
    return distance, copied


@pytest.mark.parametrize("k", [1, 3, 12])
def test_last_repeat_equals_a_plain_loop(k):
    rng = np.random.default_rng(k)
    for data in [rng.integers(0, 3, 3000), rng.integers(0, 256, 500), np.zeros(40), []]:
        got, expected = B.last_repeat(data, k), reference_last_repeat(data, k)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])


def test_compressor_bits_pay_little_for_what_came_before_and_fail_on_bad_input():
    """A part that repeats text seen 100 KB earlier is nearly free for xz, whose window holds
    it, and not for gzip, whose 32 KB window does not; fresh random bytes cost every codec
    about 8 bits; the figure is the difference of two compressed sizes, not the part alone."""
    rng = np.random.default_rng(0)
    text = rng.integers(97, 101, 20_000, dtype=np.uint8)  # 4 letters: 2 bits/byte of entropy
    before = np.concatenate([text, rng.integers(0, 256, 100_000, dtype=np.uint8)])
    repeated = B.compressor_bits(before, text)
    assert repeated["xz -9e"] < 0.5, repeated
    assert 1.9 < repeated["gzip -9"] < 3.3, repeated  # re-codes the letters from scratch
    fresh = B.compressor_bits(before, rng.integers(0, 256, 20_000, dtype=np.uint8),
                              ["gzip -9", "bzip2 -9"])
    assert list(fresh) == ["gzip -9", "bzip2 -9"]
    assert all(7.9 < b < 8.3 for b in fresh.values()), fresh
    alone = B.compressor_bits(b"", text, ["xz -9e"])["xz -9e"]
    assert 1.9 < alone < 2.6, alone  # with nothing before, the letters cost their entropy
    with pytest.raises(ValueError, match="unknown compressors.*zstd"):
        B.compressor_bits(before, text, ["zstd"])
    with pytest.raises(ValueError, match="empty"):
        B.compressor_bits(before, b"")


def copy_stream(copies, size=20_000, seed=0):
    """Random bytes in which segment p:p+length is overwritten by the bytes `distance` before it,
    for each (p, length, distance) of `copies` (sources in untouched random bytes)."""
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    for p, length, distance in copies:
        data[p:p + length] = data[p - distance:p - distance + length]
    return data


def test_copy_classes_put_bytes_copied_from_known_distances_in_their_class():
    """Segments copied from 300, 512, 513, 4,000, 4,096 and 9,000 bytes back (sources and
    targets all disjoint): each byte of a segment past its first k (whose k bytes before it all
    lie in the copy) is copyable from that distance and lands in its class (<= 512: 0,
    513-4,096: 1, further: 2); the first k bytes, the byte after a segment and the random
    bytes are class 2 (no copy)."""
    k, copies = 12, [(15_000, 200, 300), (16_000, 100, 512), (17_000, 100, 513),
                     (18_000, 300, 4_000), (19_700, 100, 4_096), (19_850, 150, 9_000)]
    data = copy_stream(copies)
    classes = B.copy_classes(data, (512, 4096), k)
    expected = np.full(len(data), 2, np.int8)
    for p, length, distance in copies:
        expected[p + k:p + length] = 0 if distance <= 512 else 1 if distance <= 4096 else 2
    np.testing.assert_array_equal(classes, expected)
    assert B.copy_class_names((512, 4096)) == [
        "copy 1-512 back", "copy 513-4,096 back", "rest (no copy within 4,096)"]
    distance, copied = B.last_repeat(data, k)
    for p, length, d in copies:
        assert (distance[p + k:p + length] == d).all() and copied[p + k:p + length].all()
    assert distance[15_200] == 300 and not copied[15_200]  # seen, but another byte follows
    # The shares agree with repeat_reach's.
    reach = B.repeat_reach(data, [512, 4096], k)
    counts = np.bincount(classes, minlength=3)
    assert counts[0] / (len(data) - k) == pytest.approx(reach[512]["copied"])
    assert (counts[0] + counts[1]) / (len(data) - k) == pytest.approx(reach[4096]["copied"])
    for bad in [(), (512, 512), (0, 8), (4096, 512)]:
        with pytest.raises(ValueError, match="edges"):
            B.copy_classes(data, bad)


@pytest.mark.parametrize("min_context, batch_size", [(None, 3), (40, 5)])
def test_bits_by_copy_class_average_to_the_bits_and_equal_hand_computed(
        text_run, min_context, batch_size):
    """The generated stream repeats rows 128 bytes back (`sources.embedded_bytes`), so with
    edges (16, 128) most copyable bytes are class 1. Each class's count and bits equal the
    hand-computed ones of its targets; weighted by their counts the classes give the overall
    bits exactly (the same float32 partials summed in float64), and so do the positions."""
    result = E.evaluate(text_run, "valid", 4, min_context, batch_size, copy_edges=(16, 128),
                        progress=False, write=False)
    bits, mask, _ = hand_nll(text_run, "valid", 4, min_context)
    config = config_lib.read_record(text_run)
    data = D.make_dataset(config.data, 64).splits["valid"]
    classes_T = B.copy_classes(data, (16, 128), E.COPY_K)
    windows = eval_windows(data, 64, min_context)
    target_T = np.minimum(windows.starts[:, None] + 1 + np.arange(64), len(data) - 1)
    classes = result["copy_classes"]
    assert classes["k"] == 12 and classes["edges"] == [16, 128]
    assert [c["name"] for c in classes["classes"]] == B.copy_class_names((16, 128))
    assert [c["count"] for c in classes["classes"]] == np.bincount(classes_T[1:], minlength=3
                                                                    ).tolist()
    assert classes["classes"][1]["share"] > 0.5  # the rows copied 128 bytes back
    assert classes["classes"][0] == {"name": "copy 1-16 back", "count": 0, "share": 0.0,
                                     "bits": None}  # the stream copies only from 128 back
    for c, row in enumerate(classes["classes"][1:], 1):
        in_class = mask & (classes_T[target_T] == c)
        assert row["count"] == in_class.sum() > 0
        assert row["bits"] == pytest.approx(bits[in_class].mean(), rel=1e-5)
    total = sum(c["bits"] * c["count"] for c in classes["classes"] if c["count"])
    assert total / result["num_scored"] == pytest.approx(result["bits"], rel=1e-12)
    assert sum(c["share"] for c in classes["classes"]) == pytest.approx(1, rel=1e-12)
    positions = sum(b["bits"] * b["count"] for b in result["by_position"] if b["count"])
    assert positions / result["num_scored"] == pytest.approx(result["bits"], rel=1e-12)
    assert result["bits"] == pytest.approx(bits[mask].mean(), rel=1e-5)
    table = E.format_classes(result)
    assert "| copy 17-128 back |" in table and "| rest (no copy within 128) |" in table
    for bad in [(128, 16), (0,), (16.5,)]:
        with pytest.raises(ValueError, match="copy_edges"):
            E.evaluate(text_run, "valid", copy_edges=bad, progress=False, write=False)
    plain = E.evaluate(text_run, "valid", 4, min_context, batch_size, copy_edges=(),
                       progress=False, write=False)
    assert "copy_classes" not in plain and E.format_classes(plain) == ""
    assert plain["bits"] == pytest.approx(result["bits"], rel=1e-6)
