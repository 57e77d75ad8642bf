"""Sampling from a checkpoint: text, images and image completion, written to files.

  python scripts/sample.py --workdir=DIR --num_samples=4 --length=512 --temperature=0.9 \
      [--top_k=K | --top_p=P] [--prompt="text" | --prompt_file=F] [--seed=S] [--output=PATH]
  python scripts/sample.py --workdir=DIR --complete=8       # image models: complete test images

The tokens come from ``sparse_jax.model.decode.generate``, the pattern-aware key/value-cache decoder
(its module docstring: the decoder and the sampling options). This module holds the prompts,
the outputs and the ``sample`` entry point.

Conventions. Text: prompts are bytes (``--prompt`` is UTF-8 text, ``--prompt_file`` is read as
raw bytes, any values); position 0 always reads a real byte, so without a prompt sampling starts
from a newline. Samples are of any length: past the context n the window slides (the scheme is
``model.decode``'s: a full window of n + 1 bytes is followed by one that re-reads its last
n // 2 bytes from position 0, so each byte is drawn from the model's distribution given the
window before it, at least n // 2 bytes and at most n, and past the first window a byte costs
about two cached steps). A prompt longer than n is cut to its last n bytes, with one
``warning:`` line saying so; the samples hold the cut prompt. Images: position 0 reads the
constant 0 (as in training), so a sample is n new sub-pixels after the prompt [0], one image,
never more; completion prompts with [0] + the top half of an image. Completion takes N images
spread evenly over the split (its first and last included) and samples their bottom halves. A
fixed seed gives the same samples for the same model, batch and prompt (a shorter text sample
is the start of a longer one). Outputs: ``DIR/samples/<step>_seed<S>.txt`` (raw bytes, each
sample after a header line), ``<step>_seed<S>.png`` (a grid of images),
``<step>_complete_<split>_seed<S>.png`` (three rows: the originals, what the model was shown
(bottom halves grey), its completions; small pictures are enlarged to 96 pixels or more a side,
each pixel a square: ``completion_zoom``); ``--output`` overrides the path.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from sparse_jax import logs
from sparse_jax.data import datasets as data_lib
from sparse_jax.files import atomic_write, write_error
from sparse_jax.model.decode import check_length, check_sampling, generate
from sparse_jax.run import checkpoints, setup
from sparse_jax.run import workdir as workdir_lib

DEFAULT_TEXT_LENGTH = 256
HIDDEN = 128  # the grey that stands for the hidden bottom half in a completion grid


def completion_zoom(rows: int, columns: int) -> int:
    """Pixels per image pixel in a completion grid: 96 or more on the longer side."""
    return max(1, -(-96 // max(rows, columns)))


def prompt_bytes(prompt: str | bytes | None = None, prompt_file: str | None = None) -> bytes:
    """The prompt as bytes: ``prompt`` encoded as UTF-8 (ValueError if it cannot be), or the raw
    bytes of ``prompt_file``; b"" if neither is given."""
    if prompt is not None and prompt_file is not None:
        raise ValueError("give a prompt or a prompt_file, not both")
    if prompt_file is not None:
        if not os.path.isfile(prompt_file):
            raise FileNotFoundError(f"prompt file {prompt_file} does not exist or is not a file")
        with open(prompt_file, "rb") as f:
            return f.read()
    if isinstance(prompt, bytes) or prompt is None:
        return prompt or b""
    try:
        return prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the prompt is not valid UTF-8 text ({e.reason} at character "
                         f"{e.start}); pass arbitrary bytes with a prompt_file") from None


def image_grid(images_NHWC, columns: int | None = None, pad: int = 2) -> np.ndarray:
    """uint8 images [N, H, W, C] tiled into one image, ``pad`` white pixels around each."""
    n, h, w, c = images_NHWC.shape
    columns = columns or math.ceil(math.sqrt(n))
    rows = -(-n // columns)
    grid = np.full((rows * (h + pad) + pad, columns * (w + pad) + pad, c), 255, np.uint8)
    for k, image in enumerate(images_NHWC):
        r, col = divmod(k, columns)
        grid[pad + r * (h + pad):][:h, pad + col * (w + pad):][:, :w] = image
    return grid


def save_png(image_HWC: np.ndarray, path: str) -> None:
    from PIL import Image

    if image_HWC.shape[-1] not in (1, 3):
        raise ValueError(f"a PNG needs 1 or 3 channels, got {image_HWC.shape[-1]}")
    image = Image.fromarray(image_HWC[..., 0] if image_HWC.shape[-1] == 1 else image_HWC)
    _write(path, lambda f: image.save(f, format="PNG"))


def _write_text(path: str, samples: list[bytes], header: str) -> None:
    def write(f):
        for k, text in enumerate(samples):
            f.write(f"===== sample {k + 1}/{len(samples)}: {header} =====\n".encode())
            f.write(text + b"\n")

    _write(path, write)


def _write(path: str, write) -> None:
    """`write(file)` into path + ".tmp", then renamed to `path`: a failed write (a full disk)
    leaves no torn file and whatever was at `path` before; one-line OSError naming `path`."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with atomic_write(path, "wb") as f:
            write(f)
    except OSError as e:
        raise write_error(path, e, "free some space or choose another output") from e


def _output_path(workdir, output, image: bool, complete: int, split: str, seed: int,
                 step: int) -> str:
    """Where the samples of checkpoint `step` go: `output`, else WORKDIR/samples/..."""
    name = (f"{step}_complete_{split}_seed{seed}.png" if image and complete else
            f"{step}_seed{seed}.png" if image else f"{step}_seed{seed}.txt")
    return output or os.path.join(workdir, "samples", name)


def check_arguments(workdir: str, num_samples: int = 4, length: int | None = None, *,
                    temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None, prompt: str | bytes | None = None,
                    prompt_file: str | None = None, seed: int = 0, output: str | None = None,
                    checkpoint="latest", complete: int = 0, split: str = "test",
                    attention: str | None = None, overwrite: bool = False) -> dict:
    """`sample`'s checks of its arguments, before parameters or data are read
    (scripts/sample.py runs them before any work). Returns {"config", "model", "checkpoint",
    "image", "prompt" (its bytes), "text" (the prompt cut to the context), "length"}."""
    workdir_lib.check_workdir(workdir)
    checkpoint = checkpoints.parse_checkpoint(checkpoint)
    for name, value, low in (("num_samples", num_samples, 1), ("complete", complete, 0),
                             ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be a {'positive' if low else 'non-negative'} integer, "
                             f"got {value!r}")
    config, cfg = setup.recorded(workdir, attention)
    data_cfg = data_lib.data_config(config.data)
    check_sampling(temperature, top_k, top_p, cfg.vocab_size)
    image, whole, text = data_cfg.is_image, b"", b""
    if image:
        if prompt or prompt_file:
            raise ValueError("image models take no text prompt; use complete=N to condition on "
                             "the top halves of images")
        if length is not None and length != cfg.seq_len:
            raise ValueError(f"image samples are whole images of {cfg.seq_len} sub-pixels; leave "
                             f"length unset (got {length})")
        if split not in data_lib.SPLITS:
            raise ValueError(f"split must be one of {data_lib.SPLITS}, got {split!r}")
    else:
        if complete:
            raise ValueError("complete=N needs an image model (one trained on an image "
                             "dataset such as cifar10)")
        whole = prompt_bytes(prompt, prompt_file) or b"\n"
        length = DEFAULT_TEXT_LENGTH if length is None else length
        check_length(min(len(whole), cfg.seq_len), length, num_samples)  # fits memory
        text = whole[-cfg.seq_len:]
    path = _output_path(workdir, output, image, complete, split, seed,
                        checkpoints.step_of(workdir, checkpoint))
    workdir_lib.check_output(path, overwrite, create=False)
    return {"config": config, "model": cfg, "checkpoint": checkpoint, "image": image,
            "prompt": whole, "text": text, "length": length}


def sample(workdir: str, num_samples: int = 4, length: int | None = None, *,
           temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           prompt: str | bytes | None = None, prompt_file: str | None = None, seed: int = 0,
           output: str | None = None, checkpoint="latest", complete: int = 0,
           split: str = "test", attention: str | None = None, overwrite: bool = False) -> dict:
    """Samples from a checkpoint of the run in ``workdir`` and writes them (module docstring);
    an existing output file is replaced only with ``overwrite``.

    Text: ``num_samples`` continuations of the prompt (its last n bytes, n the context) by
    ``length`` bytes (default 256; any length, the window sliding past n). Images:
    ``num_samples`` whole images, or with ``complete=N`` the bottom halves of N images of
    ``split`` spread evenly over it (``picked``). Returns {"samples", "path", "step",
    "seconds", ...}: samples are bytes (prompt included) or uint8 images [N, rows, columns,
    channels]. ``attention``: the implementation to read the run with (default: the recorded
    one, or as ``config_lib.for_this_machine`` chooses where that cannot run here).
    """
    checked = check_arguments(
        workdir, num_samples, length, temperature=temperature, top_k=top_k, top_p=top_p,
        prompt=prompt, prompt_file=prompt_file, seed=seed, output=output, checkpoint=checkpoint,
        complete=complete, split=split, attention=attention, overwrite=overwrite)
    config, cfg, checkpoint = checked["config"], checked["model"], checked["checkpoint"]
    image, text, length = checked["image"], checked["text"], checked["length"]
    if not image and len(checked["prompt"]) > cfg.seq_len:
        logs.warn(f"the prompt ({len(checked['prompt'])} bytes) is longer than the model's "
                  f"context of {cfg.seq_len} bytes; it is cut to its last {cfg.seq_len} bytes")

    def output_path(step):
        return _output_path(workdir, output, image, complete, split, seed, step)

    if config.mesh.get("seq", 1) > 1:  # trained with each sequence split over devices
        print(f"Sampling on one device: decoding reads one position at a time from a key/value "
              f"cache, which splits no sequence (the run trained with mesh.seq="
              f"{config.mesh.seq}).", flush=True)
    model, config, step = checkpoints.restore_model(workdir, checkpoint, attention=cfg.attention)
    path = output_path(step)
    # Again: a damaged checkpoint may have fallen back to another step. Neither check creates a
    # folder (a refused run leaves none); the writer does.
    workdir_lib.check_output(path, overwrite, create=False)
    settings = dict(seed=seed, temperature=temperature, top_k=top_k, top_p=top_p)
    rows, columns, channels = cfg.image_shape  # of an image model: its data's (make_dataset)
    shape = (-1, rows, columns, channels)
    start = time.time()
    # image=: DataConfig.is_image tells generate whether the window may slide (a picture's never)
    if not image:  # the same prompt for every sample
        prompt_BP = np.tile(np.frombuffer(text, np.uint8), (num_samples, 1))
        tokens = generate(model, prompt_BP, length, **settings, image=image)
        samples = [bytes(row.astype(np.uint8)) for row in tokens]
        _write_text(path, samples, f"step {step}, seed {seed}, prompt {len(text)} bytes + "
                                   f"{length} new")
    elif complete:  # [0] + the top half of each image, then the bottom half sampled
        source = data_lib.make_dataset(config.data, cfg.seq_len, vocab_size=cfg.vocab_size,
                                       image_shape=cfg.image_shape).splits[split]
        if complete > len(source):
            raise ValueError(f"complete={complete} exceeds the {len(source)} {split} images")
        picked = np.round(np.linspace(0, len(source) - 1, complete)).astype(np.int64)
        originals = source.images(picked).astype(np.int32)
        half = rows // 2 * columns * channels
        prompt_BP = np.concatenate([np.zeros((complete, 1), np.int32), originals[:, :half]], 1)
        tokens = generate(model, prompt_BP, cfg.seq_len - half, **settings, image=image)
        samples = tokens[:, 1:].reshape(shape).astype(np.uint8)
        shown = originals.reshape(shape).astype(np.uint8)
        hidden = shown.copy()
        hidden[:, rows // 2:] = HIDDEN
        grid = image_grid(np.concatenate([shown, hidden, samples]), columns=complete)
        zoom = completion_zoom(rows, columns)
        save_png(grid.repeat(zoom, axis=0).repeat(zoom, axis=1), path)
    else:  # whole images after the constant 0 that position 0 reads
        prompt_BP = np.zeros((num_samples, 1), np.int32)
        tokens = generate(model, prompt_BP, cfg.seq_len, **settings, image=image)
        samples = tokens[:, 1:].reshape(shape).astype(np.uint8)
        save_png(image_grid(samples), path)
    seconds = time.time() - start
    new_tokens = tokens.shape[0] * (tokens.shape[1] - prompt_BP.shape[1])
    result = {"samples": samples, "path": path, "step": step, "seconds": seconds,
              "tokens_per_s": new_tokens / seconds, "image": image, **settings}
    if image and complete:
        result["picked"] = picked  # the completed images' indices in the split
    return result
