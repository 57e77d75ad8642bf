"""Sampling with a pattern-aware incremental decoder: text, images and image completion.

  python scripts/sample.py --workdir=DIR --num_samples=4 --length=512 --temperature=0.9 \
      [--top_k=K | --top_p=P] [--prompt="text" | --prompt_file=F] [--seed=S] [--output=PATH]
  python scripts/sample.py --workdir=DIR --complete=8       # image models: complete test images

Decoder (`generate`). Position i attends only to its pattern's keys S_i, so a step costs
O(|S_i|·d) per layer instead of a forward pass over the whole context. A cache holds the keys
and values of every layer, ``[layers, batch, positions, heads, head_dim]``, filled as positions
are fed. The step at position i embeds one token, and in each layer projects q, k, v of that
position with the layer's own modules, writes k and v into the cache, gathers for each head
group the cached keys of row i of the group's index table (``PatternSpec.indices``: int32
[positions, K], -1 padded and masked; the layer's head groups and schedule are read from the
model's attention modules), and applies the model's norms, projections, feed-forward and head.
Only this attention step is written here; dense layers attend to all cached positions <= i.
The positions are one ``jax.lax.scan`` with static shapes (layers inside it unrolled, or a scan
over the stacked groups of a ``scan_layers`` model), compiled once per (model, batch, length).
Its logits equal those of a full forward pass over the sampled sequence (float32: to ~1e-7).
The tables are device arrays of [positions, K] int32 (fixed l=128, c=32 at n=12,288: 156 MB).

Conventions. Text: prompts are bytes (``--prompt`` is UTF-8 text, ``--prompt_file`` is read as
raw bytes, any values); position 0 always reads a real byte, so without a prompt sampling starts
from a newline. A prompt of P bytes followed by L new bytes feeds P + L - 1 positions, which
must fit the context n. Images: position 0 reads the constant 0 (as in training), so a sample is
n new sub-pixels after the prompt [0]; completion prompts with [0] + the top half of an image.
Sampling: temperature 0 is greedy; top_k keeps the k most likely bytes (ties at the k-th value
are kept), top_p the smallest set of most likely bytes whose probability reaches p; both may be
combined (top-k first). A fixed seed gives the same samples for the same model, batch and
length. Outputs: ``DIR/samples/<step>_seed<S>.txt`` (raw bytes, each sample after a header
line), ``<step>_seed<S>.png`` (a grid of images), ``<step>_complete_<split>_seed<S>.png`` (rows of
original | completion); ``--output`` overrides the path.
"""

from __future__ import annotations

import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax import data as data_lib
from sparse_jax import evaluate as eval_lib
from sparse_jax import model as model_lib
from sparse_jax import train as train_lib
from sparse_jax.attention import PatternSpec

_NEG = -1e30  # masked score, as in attention.py: rows without keys give zeros, not NaN
DEFAULT_TEXT_LENGTH = 256


# ---------------------------------------------------------------------------------------------
# The incremental decoder.


def decode_specs(cfg: model_lib.ModelConfig) -> tuple[PatternSpec, ...]:
    """The distinct sparse patterns of all layers and head groups (dense needs no table)."""
    specs = {s for layer in cfg.specs() for s in layer if s.kind != "dense"}
    return tuple(sorted(specs, key=str))


def decode_tables(cfg: model_lib.ModelConfig, num_positions: int) -> tuple[np.ndarray, ...]:
    """``spec.indices(num_positions)`` for each of ``decode_specs(cfg)``: int32 [positions, K].
    (Row i of a pattern depends only on i, so tables for a prefix of the context suffice.)"""
    return tuple(spec.indices(num_positions) for spec in decode_specs(cfg))


def _attend(q_BHD, k_BKHD, v_BKHD, valid_K):
    """Softmax attention of one query per (batch, head) over K gathered keys. Scores, softmax
    and output in float32; like ``sparse_attention``, q is scaled and the probabilities enter
    the value product in the input dtype (bfloat16 compute rounds as the full pass does)."""
    q_BHD = q_BHD * jnp.asarray(1.0 / math.sqrt(q_BHD.shape[-1]), q_BHD.dtype)
    scores = jnp.einsum("bhd,bkhd->bhk", q_BHD, k_BKHD, preferred_element_type=jnp.float32)
    scores = jnp.where(valid_K, scores, _NEG)
    probs = jnp.where(valid_K, jnp.exp(scores - scores.max(-1, keepdims=True)), 0.0)
    total = probs.sum(-1, keepdims=True)
    out = jnp.einsum("bhk,bkhd->bhd", probs.astype(v_BKHD.dtype), v_BKHD,
                     preferred_element_type=jnp.float32)
    return out / jnp.maximum(total, 1e-30)  # no key at all: zeros


def _block_step(block, layer, h_B1D, cache, table_of, i):
    """One residual block at position i: writes the position's k, v into layer ``layer`` of the
    cache (a traced index under scan_layers) and attends each head group to its keys."""
    attn, batch = block.attn, h_B1D.shape[0]
    k_cache, v_cache = cache
    x_B1D = block.attn_norm(h_B1D)
    q_BHD, k_BHD, v_BHD = (proj(x_B1D).reshape(batch, attn.num_heads, -1)
                           for proj in (attn.query, attn.key, attn.value))
    k_cache = k_cache.at[layer, :, i].set(k_BHD.astype(k_cache.dtype))
    v_cache = v_cache.at[layer, :, i].set(v_BHD.astype(v_cache.dtype))
    k_BFHD, v_BFHD = k_cache[layer], v_cache[layer]
    group, outs = attn.num_heads // len(attn.specs), []
    for g, spec in enumerate(attn.specs):  # head group g attends with pattern spec
        heads = slice(g * group, (g + 1) * group)
        if spec.kind == "dense":  # every cached position <= i
            keys, values = k_BFHD[:, :, heads], v_BFHD[:, :, heads]
            valid = jnp.arange(k_BFHD.shape[1]) <= i
        else:  # row i of the pattern's index table
            row_K = table_of[spec][i]
            valid, safe = row_K >= 0, jnp.maximum(row_K, 0)
            keys, values = k_BFHD[:, safe, heads], v_BFHD[:, safe, heads]
        outs.append(_attend(q_BHD[:, heads], keys, values, valid).astype(q_BHD.dtype))
    a_B1D = attn.out(jnp.concatenate(outs, axis=1).reshape(batch, 1, -1))
    return block.finish(h_B1D, a_B1D), (k_cache, v_cache)


def decode_step(model, tables, cache, token_B, i):
    """Logits float32[B, vocab] of position i reading ``token_B``, and the updated cache.

    cache: (k [L, B, F, H, dk], v [L, B, F, H, dv]) holding positions < i; tables: as
    ``decode_tables(model.cfg, F)``. Layers run in a loop, or for ``scan_layers`` models in a
    ``jax.lax.scan`` over the stacked layer groups, as in ``SparseTransformer.from_embeddings``.
    """
    cfg = model.cfg
    table_of = dict(zip(decode_specs(cfg), tables))
    h_B1D = model.embed(token_B[:, None], jnp.asarray(i)[None])
    if not cfg.scan_layers:
        for layer, block in enumerate(model.blocks):
            h_B1D, cache = _block_step(block, layer, h_B1D, cache, table_of, i)
    else:
        graphdef, stacked = nnx.split(model.block_groups)

        def body(carry, xs):
            h_B1D, cache = carry
            state, group = xs
            for p, block in enumerate(nnx.merge(graphdef, state).blocks):
                h_B1D, cache = _block_step(block, group * cfg.period + p, h_B1D, cache,
                                           table_of, i)
            return (h_B1D, cache), None

        groups = jnp.arange(cfg.num_layers // cfg.period)
        (h_B1D, cache), _ = jax.lax.scan(body, (h_B1D, cache), (stacked, groups))
    logits = model.head(model.final_norm(h_B1D))[:, 0].astype(jnp.float32)
    return logits, cache


def filter_logits(logits, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None):
    """Logits / temperature with the bytes outside top-k / top-p set to -inf (float32)."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:
        sorted_desc = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely bytes
        cutoff = jnp.where(before < top_p, sorted_desc, jnp.inf).min(-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def sample_logits(key, logits, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None):
    """int32[B] drawn from ``logits`` [B, vocab]; temperature 0 is greedy."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, temperature, top_k, top_p)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "top_k", "top_p",
                                             "collect"))
def _decode(graphdef, state, tables, tokens_BT, num_prompt, rng, *, temperature, top_k, top_p,
            collect):
    """Feeds positions 0 .. T-2 of ``tokens_BT``; position i + 1 is the prompt's while
    i + 1 < num_prompt, else sampled. Returns (tokens, logits [T-1, B, V] or None)."""
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    batch, fed = tokens_BT.shape[0], tokens_BT.shape[1] - 1
    dtype, heads = model_lib.DTYPES[cfg.dtype], cfg.num_heads
    cache = (jnp.zeros((cfg.num_layers, batch, fed, heads, cfg.qk_dim // heads), dtype),
             jnp.zeros((cfg.num_layers, batch, fed, heads, cfg.d_model // heads), dtype))

    def body(carry, i):
        tokens, cache = carry
        logits, cache = decode_step(model, tables, cache, tokens[:, i], i)
        drawn = sample_logits(jax.random.fold_in(rng, i), logits, temperature, top_k, top_p)
        tokens = tokens.at[:, i + 1].set(jnp.where(i + 1 < num_prompt, tokens[:, i + 1], drawn))
        return (tokens, cache), (logits if collect else None)

    (tokens_BT, _), logits = jax.lax.scan(body, (tokens_BT, cache), jnp.arange(fed))
    return tokens_BT, logits


def check_sampling(temperature, top_k, top_p, vocab_size: int = 256) -> None:
    """ValueError for a negative temperature, top_k outside [1, vocab], top_p outside (0, 1]."""
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or not 1 <= top_k <= vocab_size):
        raise ValueError(f"top_k must be an integer in [1, {vocab_size}], got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def check_length(prompt_len: int, length, seq_len: int) -> None:
    """ValueError unless ``prompt_len`` + ``length`` new tokens fit a context of ``seq_len``."""
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise ValueError(f"length must be a positive integer, got {length!r}")
    if prompt_len < 1:
        raise ValueError("the prompt must hold at least one token")
    if prompt_len > seq_len:
        raise ValueError(f"the prompt ({prompt_len} bytes) is longer than the model's context "
                         f"of {seq_len} bytes")
    if prompt_len + length - 1 > seq_len:
        raise ValueError(f"a prompt of {prompt_len} bytes plus {length} new bytes needs "
                         f"{prompt_len + length - 1} positions; the context is {seq_len} (at "
                         f"most {seq_len + 1 - prompt_len} new bytes after this prompt)")


def generate(model, prompt_BP, length: int, *, seed: int = 0, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, return_logits: bool = False):
    """Continues each row of ``prompt_BP`` (int [B, P], P >= 1) by ``length`` sampled tokens.

    Returns int32 [B, P + length] (NumPy), and with ``return_logits`` also the decoder's logits
    float32 [B, P + length - 1, vocab]: row t predicts token t + 1, as ``model(tokens[:, :-1])``.
    """
    prompt_BP = np.asarray(prompt_BP)
    if prompt_BP.ndim != 2 or not np.issubdtype(prompt_BP.dtype, np.integer):
        raise ValueError(f"prompt must be an integer array [batch, P], got {prompt_BP.shape} "
                         f"{prompt_BP.dtype}")
    cfg = model.cfg
    if prompt_BP.size and (prompt_BP.min() < 0 or prompt_BP.max() >= cfg.vocab_size):
        raise ValueError(f"prompt tokens must be in [0, {cfg.vocab_size})")
    check_sampling(temperature, top_k, top_p, cfg.vocab_size)
    batch, num_prompt = prompt_BP.shape
    check_length(num_prompt, length, cfg.seq_len)
    tokens = np.zeros((batch, num_prompt + length), np.int32)
    tokens[:, :num_prompt] = prompt_BP
    tables = decode_tables(cfg, num_prompt + length - 1)
    graphdef, state = nnx.split(model)
    tokens, logits = _decode(graphdef, state, tables, tokens, num_prompt, jax.random.key(seed),
                             temperature=float(temperature), top_k=top_k,
                             top_p=None if top_p is None else float(top_p), collect=return_logits)
    tokens = np.asarray(tokens)
    return (tokens, np.asarray(logits).swapaxes(0, 1)) if return_logits else tokens


# ---------------------------------------------------------------------------------------------
# Prompts, pictures and the script's entry point.


def prompt_bytes(prompt: str | bytes | None = None, prompt_file: str | None = None) -> bytes:
    """The prompt as bytes: ``prompt`` encoded as UTF-8 (ValueError if it cannot be), or the raw
    bytes of ``prompt_file``; b"" if neither is given."""
    if prompt is not None and prompt_file is not None:
        raise ValueError("give a prompt or a prompt_file, not both")
    if prompt_file is not None:
        if not os.path.isfile(prompt_file):
            raise FileNotFoundError(f"prompt file {prompt_file} does not exist")
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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    Image.fromarray(image_HWC[..., 0] if image_HWC.shape[-1] == 1 else image_HWC).save(path)


def _write_text(path: str, samples: list[bytes], header: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        for k, text in enumerate(samples):
            f.write(f"===== sample {k + 1}/{len(samples)}: {header} =====\n".encode())
            f.write(text + b"\n")


def sample(workdir: str, num_samples: int = 4, length: int | None = None, *,
           temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           prompt: str | bytes | None = None, prompt_file: str | None = None, seed: int = 0,
           output: str | None = None, checkpoint="latest", complete: int = 0,
           split: str = "test") -> dict:
    """Samples from a checkpoint of the run in ``workdir`` and writes them (module docstring).

    Text: ``num_samples`` continuations of the prompt by ``length`` bytes (default 256 or as many
    as fit). Images: ``num_samples`` whole images, or with ``complete=N`` the bottom halves of the
    first N images of ``split``. Returns {"samples", "path", "step", "seconds", ...}: samples are
    bytes (prompt included) or uint8 images [N, rows, columns, channels].
    """
    # Every argument is checked before parameters or data are read.
    eval_lib.check_workdir(workdir)
    checkpoint = eval_lib.parse_checkpoint(checkpoint)
    for name, value, low in (("num_samples", num_samples, 1), ("complete", complete, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be a {'positive' if low else 'non-negative'} integer, "
                             f"got {value!r}")
    cfg = model_lib.model_config(train_lib.load_config(workdir).model)
    check_sampling(temperature, top_k, top_p, cfg.vocab_size)
    image = cfg.pos_emb == "image"
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
            raise ValueError("complete=N needs an image model (pos_emb='image')")
        text = prompt_bytes(prompt, prompt_file) or b"\n"
        if length is None:
            length = max(1, min(DEFAULT_TEXT_LENGTH, cfg.seq_len + 1 - len(text)))
        check_length(len(text), length, cfg.seq_len)

    model, config, step = eval_lib.restore_model(workdir, checkpoint)
    settings = dict(seed=seed, temperature=temperature, top_k=top_k, top_p=top_p)
    folder, shape = os.path.join(workdir, "samples"), (-1, *cfg.image_shape)
    start = time.time()
    if not image:  # the same prompt for every sample
        prompt_BP = np.tile(np.frombuffer(text, np.uint8), (num_samples, 1))
        tokens = generate(model, prompt_BP, length, **settings)
        samples = [bytes(row.astype(np.uint8)) for row in tokens]
        path = output or os.path.join(folder, f"{step}_seed{seed}.txt")
        _write_text(path, samples, f"step {step}, seed {seed}, prompt {len(text)} bytes + "
                                   f"{length} new")
    elif complete:  # [0] + the top half of each image, then the bottom half sampled
        source = data_lib.make_dataset(config.data, cfg.seq_len).splits[split]
        if complete > len(source):
            raise ValueError(f"complete={complete} exceeds the {len(source)} {split} images")
        originals = source.images(np.arange(complete)).astype(np.int32)
        half = cfg.image_shape[0] // 2 * math.prod(cfg.image_shape[1:])
        prompt_BP = np.concatenate([np.zeros((complete, 1), np.int32), originals[:, :half]], 1)
        tokens = generate(model, prompt_BP, cfg.seq_len - half, **settings)
        samples = tokens[:, 1:].reshape(shape).astype(np.uint8)
        gap = np.full((complete, cfg.image_shape[0], 2, cfg.image_shape[2]), 255, np.uint8)
        pairs = np.concatenate([originals.reshape(shape).astype(np.uint8), gap, samples], axis=2)
        path = output or os.path.join(folder, f"{step}_complete_{split}_seed{seed}.png")
        save_png(image_grid(pairs, columns=max(1, int(math.sqrt(complete / 2)))), path)
    else:  # whole images after the constant 0 that position 0 reads
        prompt_BP = np.zeros((num_samples, 1), np.int32)
        tokens = generate(model, prompt_BP, cfg.seq_len, **settings)
        samples = tokens[:, 1:].reshape(shape).astype(np.uint8)
        path = output or os.path.join(folder, f"{step}_seed{seed}.png")
        save_png(image_grid(samples), path)
    seconds = time.time() - start
    new_tokens = tokens.shape[0] * (tokens.shape[1] - prompt_BP.shape[1])
    return {"samples": samples, "path": path, "step": step, "seconds": seconds,
            "tokens_per_s": new_tokens / seconds, "image": image, **settings}
