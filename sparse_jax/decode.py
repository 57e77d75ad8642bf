"""Sampling with a pattern-aware key/value cache, through the model's public decoding API.

Position i attends only to its pattern's keys S_i, so a step costs O(|S_i|·d) per layer instead
of a forward pass over the whole context. ``SparseTransformer.init_cache`` holds the keys and
values of every layer, ``[layers, batch, positions, heads, head_dim]``, filled as positions are
fed; ``SparseTransformer.decode_step`` embeds the token at position i and, in each layer, writes
that position's key and value into the cache and attends, head group by head group, the cached
keys of query i in the group's pattern (``PatternSpec.row_keys``: computed from i inside the
step, a static number of candidates with the absent ones masked; a dense group attends every
cached position <= i).
``generate`` runs the positions as one ``jax.lax.scan`` with static shapes, compiled once per
(model, batch, length), drawing each new token with ``sample_logits``. Its logits equal those of
a full forward pass over the sampled sequence (float32: to ~1e-7). No per-position index table
is built or held: for fixed (l = 256, c = 64) at 65,536 positions it would be 4 GB.

A prompt of P tokens followed by L new ones feeds P + L - 1 positions, which must fit the
context n. Sampling: temperature 0 is greedy; top_k keeps the k most likely tokens (ties at the
k-th value are kept), top_p the smallest set of most likely tokens whose probability reaches p;
both may be combined (top-k first). A fixed seed gives the same samples for the same model,
batch and length.
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
def _decode(graphdef, state, tokens_BT, num_prompt, rng, *, temperature, top_k, top_p,
            collect):
    """Feeds positions 0 .. T-2 of ``tokens_BT``; position i + 1 is the prompt's while
    i + 1 < num_prompt, else sampled. Returns (tokens, logits [T-1, B, V] or None)."""
    model = nnx.merge(graphdef, state)
    batch, fed = tokens_BT.shape[0], tokens_BT.shape[1] - 1

    def body(carry, i):
        tokens, cache = carry
        logits, cache = model.decode_step(tokens[:, i], i, cache)
        drawn = sample_logits(jax.random.fold_in(rng, i), logits, temperature, top_k, top_p)
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
    graphdef, state = nnx.split(model)
    tokens, logits = _decode(graphdef, state, tokens, num_prompt, jax.random.key(seed),
                             temperature=float(temperature), top_k=top_k,
                             top_p=None if top_p is None else float(top_p), collect=return_logits)
    tokens = np.asarray(tokens)
    return (tokens, np.asarray(logits).swapaxes(0, 1)) if return_logits else tokens
