"""Sampling with a pattern-aware key/value cache, through the model's public decoding API.

Position i attends only to its pattern's keys S_i, so a step costs O(|S_i|·d) per layer instead
of a forward pass over the whole context. ``SparseTransformer.init_cache`` holds the keys and
values of every layer, ``[layers, batch, positions, heads, head_dim]``, filled as positions are
fed; ``SparseTransformer.decode_step`` embeds the token at position i and, in each layer, writes
that position's key and value into the cache and attends, head group by head group, the cached
keys of query i in the group's pattern (``PatternSpec.row_keys``: computed from i inside the
step, a static number of candidates with the absent ones masked; a dense group attends every
cached position <= i).
``generate`` runs the positions of a window (below) as one ``jax.lax.scan`` with static shapes,
drawing each new token with ``sample_logits``: compiled once per (model, batch, first window's
length), and once more for all the later windows (each n + 1 tokens, the last one padded). Its
logits equal those of a full forward pass over the window (float32: to ~1e-7). No per-position
index table is built or held: for fixed (l = 256, c = 64) at 65,536 positions it would be 4 GB.

Any length, by sliding the window. The model reads positions 0 .. n-1 (its position embeddings,
rotary phases and pattern grid are anchored at position 0), so a window is a stretch of the
sequence fed from position 0, and a token drawn in it sees every token of the window before it.
A window holds up to n + 1 tokens: the model reads the first n, and the last is drawn from the
logits of position n-1. The first window starts at the prompt's first token (at its last n
tokens if the prompt is longer than the context n: the earlier ones are never read) and decodes
until full. The next starts with the last ``keep`` tokens of the one before (default n // 2),
re-read at positions 0 .. keep-1 by the same cached steps (their logits are computed again and
not used), and decodes until full again, and so on (``windows`` lists them). So every new token
is drawn from exactly the logits that a full forward pass over the tokens of its window before
it gives at the last position, ``model(window[:, :-1])[:, -1]``: at least ``keep`` tokens of
context (in the first window, the prompt's) and at most n. Cost: a window feeds n positions for
n + 1 - keep new tokens, so past the first window a new token costs n / (n + 1 - keep) cached
steps: about 2 at the default keep. ``keep = n`` re-reads the last n tokens for every token, n
steps each: every token sees n, as with a full forward pass per token, and costs about as much.
A prompt of P and L new tokens with P + L - 1 <= n is one window: nothing is re-read.

Sampling: temperature 0 is greedy; top_k keeps the k most likely tokens (ties at the
k-th value are kept), top_p the smallest set of most likely tokens whose probability reaches p;
both may be combined (top-k first). The token at index t of the sequence is drawn with
``fold_in(key(seed), t - 1)`` whatever window it falls in, so a fixed seed gives the same
samples for the same model, batch, prompt and ``keep``, and a shorter sample is the start of a
longer one (up to float rounding where their first windows differ in length).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def filter_logits(logits, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None):
    """Logits / temperature with the tokens outside top-k / top-p set to -inf (float32)."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:
        sorted_desc = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
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
def _decode(graphdef, state, tokens_BT, num_prompt, offset, rng, *, temperature, top_k, top_p,
            collect):
    """Feeds positions 0 .. T-2 of ``tokens_BT`` (one window, at ``offset`` in the sequence);
    position i + 1 is the prompt's while i + 1 < num_prompt, else sampled with the key of
    sequence index offset + i + 1. Returns (tokens, logits [T-1, B, V] or None)."""
    model = nnx.merge(graphdef, state)
    batch, fed = tokens_BT.shape[0], tokens_BT.shape[1] - 1

    def body(carry, i):
        tokens, cache = carry
        logits, cache = model.decode_step(tokens[:, i], i, cache)
        key = jax.random.fold_in(rng, offset + i)  # that of sequence index offset + i + 1
        drawn = sample_logits(key, logits, temperature, top_k, top_p)
        tokens = tokens.at[:, i + 1].set(jnp.where(i + 1 < num_prompt, tokens[:, i + 1], drawn))
        return (tokens, cache), (logits if collect else None)

    carry = (tokens_BT, model.init_cache(batch, fed))
    (tokens_BT, _), logits = jax.lax.scan(body, carry, jnp.arange(fed))
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


def check_length(prompt_len: int, length) -> None:
    """ValueError unless ``length`` is a positive integer and the prompt holds a token."""
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise ValueError(f"length must be a positive integer, got {length!r}")
    if prompt_len < 1:
        raise ValueError("the prompt must hold at least one token")


def windows(num_prompt: int, length: int, seq_len: int, keep: int) -> list[tuple[int, int, int]]:
    """The windows that continue a prompt of ``num_prompt`` tokens by ``length`` (module
    docstring): (start, known, end) each, in sequence indices; the window is tokens
    start .. end-1, fed at positions 0 .. end-start-2, of which start .. known-1 are known (the
    prompt's or the window before's) and known .. end-1 are drawn in it."""
    start, known, total, out = max(0, num_prompt - seq_len), num_prompt, num_prompt + length, []
    while known < total:
        end = min(start + seq_len + 1, total)
        out.append((start, known, end))
        start, known = end - keep, end
    return out


def generate(model, prompt_BP, length: int, *, seed: int = 0, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, keep: int | None = None,
             return_logits: bool = False):
    """Continues each row of ``prompt_BP`` (int [B, P], P >= 1, any P) by ``length`` sampled
    tokens, sliding the window past the context (module docstring; ``keep``: the tokens a new
    window starts with, 1 .. n, default n // 2). Only the last n prompt tokens are read.

    Returns int32 [B, P + length] (NumPy), and with ``return_logits`` also float32
    [B, P + length - 1, vocab]: row t predicts token t + 1 (drawn from it if new), as the full
    forward pass over the window that held token t + 1 does (the first window for the prompt's;
    NaN for the prompt tokens before it). Within one window that is ``model(tokens[:, :-1])``.
    """
    prompt_BP = np.asarray(prompt_BP)
    if prompt_BP.ndim != 2 or not np.issubdtype(prompt_BP.dtype, np.integer):
        raise ValueError(f"prompt must be an integer array [batch, P], got {prompt_BP.shape} "
                         f"{prompt_BP.dtype}")
    cfg = model.cfg
    n = cfg.seq_len
    if prompt_BP.size and (prompt_BP.min() < 0 or prompt_BP.max() >= cfg.vocab_size):
        raise ValueError(f"prompt tokens must be in [0, {cfg.vocab_size})")
    check_sampling(temperature, top_k, top_p, cfg.vocab_size)
    batch, num_prompt = prompt_BP.shape
    check_length(num_prompt, length)
    keep = max(1, n // 2) if keep is None else keep
    if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or not 1 <= keep <= n:
        raise ValueError(f"keep must be an integer in [1, {n}] (the context), got {keep!r}")
    tokens = np.zeros((batch, num_prompt + length), np.int32)
    tokens[:, :num_prompt] = prompt_BP
    logits = np.full((batch, num_prompt + length - 1, cfg.vocab_size), np.nan, np.float32) \
        if return_logits else None
    graphdef, state = nnx.split(model)
    rng = jax.random.key(seed)
    settings = dict(temperature=float(temperature), top_k=top_k,
                    top_p=None if top_p is None else float(top_p), collect=return_logits)
    for k, (start, known, end) in enumerate(windows(num_prompt, length, n, keep)):
        # Past the first window every window is n + 1 long (the last one padded, its extra
        # tokens dropped): one compilation for all of them.
        width = end - start if k == 0 else n + 1
        window = np.zeros((batch, width), np.int32)
        window[:, :known - start] = tokens[:, start:known]
        drawn, window_logits = _decode(graphdef, state, window, known - start, start, rng,
                                       **settings)
        tokens[:, known:end] = np.asarray(drawn)[:, known - start:end - start]
        if return_logits:  # the first window's rows of the prompt too, later ones only drawn
            first = start if k == 0 else known - 1
            logits[:, first:end - 1] = np.asarray(window_logits).swapaxes(0, 1)[
                :, first - start:end - 1 - start]
    return (tokens, logits) if return_logits else tokens
