"""Sampling: the cached decoder's logits equal the full forward pass for every attention schedule,
and past the context each byte's logits equal the full forward pass over the window it was drawn
in; seeds and greedy decoding, top-k / top-p / temperature, text and image outputs, the script,
and bad input."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from sparse_jax import sample as S
from sparse_jax.attention.spec import PatternSpec
from sparse_jax.data import cifar10
from sparse_jax.data.cifar10 import cifar10_source
from sparse_jax.model import decode
from sparse_jax.model.config import ModelConfig
from sparse_jax.model.transformer import SparseTransformer
from sparse_jax.run import checkpoints
from test_evaluate import ROOT, TINY_TEXT, get_config, save_like_train

TINY = dict(seq_len=32, num_layers=2, d_model=16, num_heads=2, stride=4, c=1)
SCHEDULES = {
    "strided-merged": dict(pattern="strided"),
    "strided-interleaved": dict(pattern="strided", mode="interleaved"),
    "fixed-merged": dict(pattern="fixed"),
    "fixed-distinct-multihead": dict(pattern="fixed", c=2, mode="multihead",  # 2 head groups
                                     distinct_summaries=True),
    "openai-cycle-scanned": dict(pattern="strided", schedule="local,local,strided", num_layers=3,
                                 scan_layers=True),
    "dense-image-positions": dict(pattern="dense", pos_emb="image", image_shape=(4, 4, 2)),
}


def make(seed=0, scale=4.0, **overrides):
    """A random model with weights scaled up so that logits are O(1) and attention is peaked."""
    model = SparseTransformer(ModelConfig(**{**TINY, **overrides}), rngs=nnx.Rngs(seed))
    nnx.update(model, jax.tree.map(lambda x: x * scale, nnx.state(model, nnx.Param)))
    return model


full_forward = nnx.jit(lambda model, tokens: model(tokens))
PROMPT = np.array([[5, 7, 9], [200, 1, 3]])


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_cached_logits_equal_full_forward_at_every_position(name):
    model = make(**SCHEDULES[name])
    tokens, logits = decode.generate(model, PROMPT, 30, seed=1, return_logits=True)
    assert tokens.shape == (2, 33) and logits.shape == (2, 32, 256)
    np.testing.assert_array_equal(tokens[:, :3], PROMPT)
    full = np.asarray(full_forward(model, jnp.asarray(tokens[:, :-1])))
    assert full.std() > 0.3  # not a trivially small comparison
    np.testing.assert_allclose(logits, full, atol=1e-4, rtol=0)


def test_the_comparison_catches_a_wrong_pattern(monkeypatch):
    """The decoder attending the local pattern's keys where the model's are strided."""
    model = make(pattern="strided")
    local = PatternSpec("local", stride=TINY["stride"])
    keys = PatternSpec.row_keys
    monkeypatch.setattr(PatternSpec, "row_keys", lambda self, i, n, xp=np: keys(local, i, n, xp))
    decode._decode.clear_cache()  # the keys are traced into the compiled decoder: no reuse
    try:
        tokens, logits = decode.generate(model, PROMPT, 30, seed=1, return_logits=True)
    finally:
        decode._decode.clear_cache()  # nor of this wrong one by later tests
    full = np.asarray(full_forward(model, jnp.asarray(tokens[:, :-1])))
    assert np.abs(logits - full)[:, :4].max() < 1e-4  # the patterns agree on the first row
    assert np.abs(logits - full).max() > 1e-2


def test_seeds_greedy_and_prompts():
    model = make(pattern="strided")  # every call below decodes [2, 33] tokens: two compilations
    prompt = np.full((2, 1), 5)
    a = decode.generate(model, prompt, 32, seed=3, top_k=40)
    np.testing.assert_array_equal(a, decode.generate(model, prompt, 32, seed=3, top_k=40))
    assert not np.array_equal(a, decode.generate(model, prompt, 32, seed=4, top_k=40))
    assert not np.array_equal(a[0], a[1])  # rows of one batch are independent samples
    greedy = decode.generate(model, PROMPT, 30, temperature=0)
    full = np.asarray(full_forward(model, jnp.asarray(greedy[:, :-1])))
    np.testing.assert_array_equal(greedy[:, 3:], full.argmax(-1)[:, 2:])
    assert decode.generate(model, np.zeros((2, 32), int), 1, temperature=0).shape == (2, 33)
    for keep in (0, 33, 2.0, True):
        with pytest.raises(ValueError, match=r"keep must be an integer in \[1, 32\]"):
            decode.generate(model, prompt, 40, keep=keep)
    with pytest.raises(ValueError, match="length must be a positive integer"):
        decode.generate(model, prompt, 0)


def test_windows_slide_by_n_plus_1_minus_keep():
    """(start, known, end): tokens start..end-1 fed from position 0, known..end-1 drawn."""
    assert decode.windows(3, 30, 32, 16) == [(0, 3, 33)]  # fits: one window, nothing re-read
    assert decode.windows(3, 96, 32, 16) == [(0, 3, 33), (17, 33, 50), (34, 50, 67),
                                             (51, 67, 84), (68, 84, 99)]
    assert decode.windows(40, 3, 32, 16) == [(8, 40, 41), (25, 41, 43)]  # the last 32 read
    assert decode.windows(1, 4, 4, 4) == [(0, 1, 5)]
    assert decode.windows(2, 5, 4, 4) == [(0, 2, 5), (1, 5, 6), (2, 6, 7)]  # keep = n: 1 each
    for prompt, length, n, keep in [(3, 96, 32, 16), (40, 50, 32, 31), (1, 100, 8, 1)]:
        spans = decode.windows(prompt, length, n, keep)
        drawn = [t for _, known, end in spans for t in range(known, end)]
        assert drawn == list(range(prompt, prompt + length))  # each new token once, in order
        assert all(end - start <= n + 1 and known - start >= min(keep, prompt)
                   for start, known, end in spans)


@pytest.mark.parametrize("overrides, keep", [(dict(pattern="strided"), None),
                                             (dict(pattern="fixed", rotary=True), 24)])
def test_past_the_context_each_byte_is_drawn_from_the_full_forward_of_its_window(overrides,
                                                                                    keep):
    """3 contexts of new bytes: every drawn byte's logits equal row -1 of the full forward pass
    over the window before it (the first byte after each re-read included), as `windows` lays
    them out; greedy bytes are their argmax."""
    model, n = make(**overrides), TINY["seq_len"]
    tokens, logits = decode.generate(model, PROMPT, 3 * n, seed=2, top_k=50, keep=keep,
                                     return_logits=True)
    assert tokens.shape == (2, 3 + 3 * n) and logits.shape == (2, 2 + 3 * n, 256)
    spans = decode.windows(3, 3 * n, n, keep or n // 2)
    assert len(spans) >= 4
    for start, known, end in spans:
        full = np.asarray(full_forward(model, jnp.asarray(tokens[:, start:end - 1])))
        np.testing.assert_allclose(logits[:, known - 1:end - 1], full[:, known - 1 - start:],
                                   atol=1e-4, rtol=0)
        # The check has teeth: the first drawn byte after a re-read, fed one byte later.
        if start:
            shifted = np.asarray(full_forward(model, jnp.asarray(tokens[:, start + 1:known])))
            assert np.abs(logits[:, known - 1] - shifted[:, -1]).max() > 1e-2
    greedy = decode.generate(model, PROMPT, 3 * n, temperature=0, keep=keep)
    for start, known, end in spans:
        full = np.asarray(full_forward(model, jnp.asarray(greedy[:, start:end - 1])))
        np.testing.assert_array_equal(greedy[:, known:end], full.argmax(-1)[:, known - 1 - start:])


def test_sliding_is_deterministic_and_reads_only_the_last_n_prompt_tokens():
    model, n = make(pattern="strided"), TINY["seq_len"]
    a = decode.generate(model, PROMPT, 3 * n, seed=7)
    np.testing.assert_array_equal(a, decode.generate(model, PROMPT, 3 * n, seed=7))
    assert not np.array_equal(a, decode.generate(model, PROMPT, 3 * n, seed=8))
    np.testing.assert_array_equal(a[:, :3 + 40], decode.generate(model, PROMPT, 40, seed=7))
    rng = np.random.default_rng(0)
    long_BP = rng.integers(0, 256, (2, n + 9))
    other_BP = long_BP.copy()
    other_BP[:, :9] = rng.integers(0, 256, (2, 9))  # differs only before the last n tokens
    b = decode.generate(model, long_BP, 50, seed=1)
    np.testing.assert_array_equal(b[:, :n + 9], long_BP)  # the whole prompt is returned
    np.testing.assert_array_equal(b[:, n + 9:], decode.generate(model, other_BP, 50,
                                                                 seed=1)[:, n + 9:])


def test_a_picture_models_window_never_slides():
    """A picture model (position tables of one picture) reads sub-pixel p - 1 at position p:
    a window started after the picture's start would read each one as another channel, so
    ``generate`` takes at most the 0 and one picture, in one window, and refuses more in one
    line; ``image=`` says what the data says (DataConfig.is_image), whatever the tables."""
    picture, n = make(pattern="dense", pos_emb="image", image_shape=(4, 4, 2)), TINY["seq_len"]
    assert decode.generate(picture, np.zeros((2, 1), int), n, seed=1).shape == (2, n + 1)
    for prompt_BP, length in [(np.zeros((2, 1), int), n + 1), (PROMPT, n - 1),
                              (np.zeros((1, n + 1), int), 1)]:
        with pytest.raises(ValueError) as e:
            decode.generate(picture, prompt_BP, length)
        message = str(e.value)
        assert "\n" not in message and message.startswith(
            f"a picture model reads one picture of {n} sub-pixels after the constant 0") and \
            f"more than {n + 1}; give at most {max(0, n + 1 - prompt_BP.shape[1])} new" in message
    assert decode.generate(picture, PROMPT, n, image=False).shape == (2, n + 3)  # told: text
    with pytest.raises(ValueError, match="a picture model reads one picture"):
        decode.generate(make(pattern="strided"), PROMPT, n, image=True)


def test_a_length_that_cannot_fit_in_memory_is_one_line_not_a_memory_error():
    model = make(pattern="strided")
    with pytest.raises(ValueError) as e:
        decode.generate(model, PROMPT, 10**12)
    assert "\n" not in str(e.value) and str(e.value).startswith(
        "length=1,000,000,000,000 cannot be held: 2 sample(s) of 1,000,000,000,003 tokens need")
    with pytest.raises(ValueError, match="give a length below"):
        decode.check_length(3, 10**15)
    decode.check_length(3, 10**6, batch=4)  # 40 MB: fits


def test_a_sample_of_many_windows_shows_its_progress(capsys):
    """More than PROGRESS_WINDOWS windows: progress lines on stderr (not a terminal: every
    10%, the last one 100%); one window: none."""
    model, n = make(pattern="strided"), TINY["seq_len"]
    decode.generate(model, PROMPT, 4 * n, seed=1)
    spans = len(decode.windows(3, 4 * n, n, n // 2))
    assert spans > decode.PROGRESS_WINDOWS
    lines = capsys.readouterr().err.splitlines()
    assert lines and lines[-1].startswith(f"sample: {spans}/{spans} (100%)"), lines
    assert "tokens/s" in lines[-1]
    decode.generate(model, PROMPT, n - 2, seed=1)
    assert capsys.readouterr().err == ""


def test_filter_logits_top_k_top_p_temperature():
    logits = jnp.log(jnp.array([[0.1, 0.4, 0.2, 0.3]]))
    kept = lambda **kw: np.isfinite(np.asarray(decode.filter_logits(logits, **kw)))[0].tolist()  # noqa
    assert kept(top_k=2) == [False, True, False, True]
    assert kept(top_k=4) == kept(top_p=1.0) == [True] * 4
    assert kept(top_p=0.3) == [False, True, False, False]  # 0.4 alone reaches 0.3
    assert kept(top_p=0.5) == [False, True, False, True]  # 0.4 < 0.5, then 0.3
    assert kept(top_k=3, top_p=0.9) == [False, True, True, True]
    np.testing.assert_allclose(decode.filter_logits(logits, 2.0), logits / 2.0)
    draws = np.asarray(decode.sample_logits(jax.random.key(0), jnp.tile(logits, (20000, 1)),
                                            temperature=1.0, top_k=3))
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, [0, 4 / 9, 2 / 9, 3 / 9], atol=0.015)
    draws = np.asarray(decode.sample_logits(jax.random.key(1), jnp.tile(logits, (20000, 1)), 0.5))
    p = np.array([0.1, 0.4, 0.2, 0.3]) ** 2
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / len(draws), p / p.sum(),
                               atol=0.015)
    assert decode.sample_logits(None, logits, temperature=0).tolist() == [1]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("sample") / "run")
    save_like_train(get_config("quickstart", "data=embedded", **TINY_TEXT), workdir, step=3)
    return workdir


def test_text_samples_from_a_workdir(text_run, tmp_path):
    result = S.sample(text_run, 2, 10, prompt="ab", seed=1, top_p=0.9)
    assert [s[:2] for s in result["samples"]] == [b"ab", b"ab"]
    assert [len(s) for s in result["samples"]] == [12, 12] and result["step"] == 3
    assert result["path"] == os.path.join(text_run, "samples", "3_seed1.txt")
    written = open(result["path"], "rb").read()
    assert all(s in written for s in result["samples"]) and written.count(b"===== sample") == 2
    with pytest.raises(FileExistsError, match="3_seed1.txt exists.*--overwrite"):
        S.sample(text_run, 2, 10, prompt="cd", seed=1, top_p=0.9)  # never replaced unasked
    assert open(result["path"], "rb").read() == written
    again = S.sample(text_run, 2, 10, prompt="ab", seed=1, top_p=0.9, overwrite=True)
    assert again["samples"] == result["samples"]
    raw = tmp_path / "prompt.bin"
    raw.write_bytes(b"\xff\xfe\x00")  # not UTF-8: a prompt file is read as bytes
    out = S.sample(text_run, 1, prompt_file=str(raw), output=str(tmp_path / "out.txt"))
    assert out["samples"][0][:3] == b"\xff\xfe\x00" and len(out["samples"][0]) == 3 + 256
    assert out["path"] == str(tmp_path / "out.txt")  # default length: 256, past the context
    assert len(S.sample(text_run, 1)["samples"][0]) == 257  # no prompt: a newline, then 256


def test_a_prompt_longer_than_the_context_is_cut_with_one_line(text_run, tmp_path, capsys):
    prompt = b"\x01" * 10 + bytes(range(100, 164))  # the context is 64
    result = S.sample(text_run, 2, 5, prompt=prompt, output=str(tmp_path / "cut.txt"))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "prompt" in line]
    assert warnings == ["warning: the prompt (74 bytes) is longer than the model's context of "
                        "64 bytes; it is cut to its last 64 bytes"]
    assert [s[:64] for s in result["samples"]] == [prompt[10:]] * 2
    assert [len(s) for s in result["samples"]] == [69, 69]
    S.sample(text_run, 1, 5, prompt=prompt[10:], output=str(tmp_path / "fits.txt"))
    assert "prompt" not in capsys.readouterr().err  # a prompt that fits: no line


def test_bad_input_fails_before_any_expensive_work(text_run, tmp_path, monkeypatch):
    def expensive(*args, **kwargs):
        raise AssertionError("checks must come before restoring parameters")

    monkeypatch.setattr(checkpoints, "restore_model", expensive)
    for kwargs, message in [
            (dict(num_samples=0), "num_samples"), (dict(num_samples=-2), "num_samples"),
            (dict(length=0), "length"), (dict(length=2.5), "length"),
            (dict(prompt="caf\udce9"), "not valid UTF-8"),
            (dict(prompt="a", prompt_file=str(tmp_path)), "not both"),
            (dict(temperature=-1.0), "temperature"), (dict(top_k=0), "top_k"),
            (dict(top_k=257), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
            (dict(checkpoint="newest"), "checkpoint"), (dict(complete=2), "image model")]:
        with pytest.raises(ValueError, match=message):
            S.sample(text_run, **kwargs)
    before = sorted(os.listdir(text_run))
    with pytest.raises(ValueError) as e:  # was: a MemoryError traceback after loading
        S.sample(text_run, length=10**12)
    assert "\n" not in str(e.value) and "length=1,000,000,000,000 cannot be held" in str(e.value)
    assert sorted(os.listdir(text_run)) == before  # no samples folder, nothing written
    with pytest.raises(FileNotFoundError, match="does not exist"):
        S.sample(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="prompt file"):
        S.sample(text_run, prompt_file=str(tmp_path / "missing.txt"))


def test_script_prints_and_writes_samples(text_run, tmp_path):
    """Past the context: a prompt of 70 bytes (cut to 64, one line) and 3 contexts of new bytes
    (the window re-read 5 times)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    script = os.path.join(ROOT, "scripts", "sample.py")
    out = tmp_path / "s.txt"
    proc = subprocess.run([sys.executable, script, f"--workdir={text_run}", "--num_samples=2",
                           "--length=192", "--prompt=" + "x" * 65 + "hello", "--top_k=10",
                           "--temperature=0.8", f"--output={out}"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("x" * 59 + "hello") == 2 and f"Wrote {out}" in proc.stdout
    assert [line for line in proc.stderr.splitlines() if "prompt" in line] == [
        "warning: the prompt (70 bytes) is longer than the model's context of 64 bytes; it is "
        "cut to its last 64 bytes"]
    written = out.read_bytes()
    headers = [f"===== sample {k}/2: step 3, seed 0, prompt 64 bytes + 192 new =====\n".encode()
               for k in (1, 2)]
    assert all(h in written for h in headers) and written.count(b"x" * 59 + b"hello") == 2
    assert len(written) == sum(len(h) + 64 + 192 + 1 for h in headers)
    bad = subprocess.run([sys.executable, script, f"--workdir={text_run}", "--num_samples=0"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "num_samples must be a positive integer" in bad.stderr


def test_images_and_completion(cifar, tmp_path, monkeypatch):
    data_dir, _ = cifar
    monkeypatch.setattr(cifar10, "CIFAR10_VALID_SIZE", 4)  # of the 20 images of the tiny archive
    config = get_config("cifar10", "size=tiny", data__data_dir=data_dir, model__d_model=8,
                        model__num_heads=1)
    workdir = str(tmp_path / "run")
    save_like_train(config, workdir)
    result = S.sample(workdir, 2, seed=5)
    assert result["samples"].shape == (2, 32, 32, 3) and result["path"].endswith("1_seed5.png")
    assert Image.open(result["path"]).size == (2 * 34 + 2, 36)
    done = S.sample(workdir, complete=2, seed=5)
    assert list(done["picked"]) == [0, 4]  # the first and the last of the 5 test images
    originals = cifar10_source("test", data_dir).images([0, 4]).reshape(2, 32, 32, 3)
    np.testing.assert_array_equal(done["samples"][:, :16], originals[:, :16])  # the top halves
    assert not np.array_equal(done["samples"][:, 16:], originals[:, 16:])
    assert done["path"].endswith("1_complete_test_seed5.png")
    zoom = S.completion_zoom(32, 32)  # 3 rows (originals, shown, completed) x 2, enlarged
    assert zoom == 3 and Image.open(done["path"]).size == (zoom * (2 * 34 + 2), zoom * (3 * 34 + 2))
    with pytest.raises(ValueError, match="no text prompt"):
        S.sample(workdir, prompt="a")
    with pytest.raises(ValueError, match="whole images of 3072 sub-pixels; leave length unset"):
        S.sample(workdir, length=3 * 3072)  # an image model never slides past one image
    with pytest.raises(ValueError, match="exceeds the 5 test images"):
        S.sample(workdir, complete=6)
