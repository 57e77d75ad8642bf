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
A prompt of P and L new tokens with P + L - 1 <= n is one window: nothing is re-read. A sample
of more than ``PROGRESS_WINDOWS`` windows shows its progress (windows, tokens per second, time
left) on stderr.

A picture model's window never slides: position p reads sub-pixel p - 1 of one picture (the
constant 0 at position 0) and its position tables say which row, column and channel that is, so
a window that started anywhere but at the picture's start would read every sub-pixel as another
(a keep of n: one channel off). ``generate`` refuses a picture model's prompt and length that do
not fit one window of n + 1 tokens (the picture and the 0 before it).

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

from sparse_jax import cli, logs

PROGRESS_WINDOWS = 4  # a sample of more windows than this shows its progress
TOKEN_BYTES = 10  # host memory per sampled token, at most: int32 tokens, their bytes, the text


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


def available_memory() -> int | None:
    """Bytes of host memory a new allocation could get now (`cli.available_memory`)."""
    return cli.available_memory()


def check_length(prompt_len: int, length, batch: int = 1,
                 bytes_per_token: int = TOKEN_BYTES) -> None:
    """ValueError unless ``length`` is a positive integer, the prompt holds a token and the
    ``batch`` sequences of ``prompt_len + length`` tokens fit the host memory available now,
    at ``bytes_per_token`` each (one line that says how long a sample fits)."""
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise ValueError(f"length must be a positive integer, got {length!r}")
    if prompt_len < 1:
        raise ValueError("the prompt must hold at least one token")
    available = available_memory()
    need = batch * (prompt_len + length) * bytes_per_token
    if available is not None and need > available:
        fits = max(0, available // (batch * bytes_per_token) - prompt_len)
        if fits < 1:  # not even one token each: the samples are too many, not too long
            most = available // ((prompt_len + 1) * bytes_per_token)
            raise ValueError(f"num_samples={batch:,} cannot be held: that many samples of "
                             f"{prompt_len + 1:,} tokens or more need about "
                             f"{batch * (prompt_len + 1) * bytes_per_token / 2**30:,.1f} GiB of "
                             f"host memory, and {available / 2**30:,.1f} GiB are available; "
                             f"give at most {most:,} samples (far fewer for a long length)")
        raise ValueError(f"length={length:,} cannot be held: {batch} sample(s) of "
                         f"{prompt_len + length:,} tokens need about {need / 2**30:,.1f} GiB of "
                         f"host memory ({bytes_per_token} bytes a token), and "
                         f"{available / 2**30:,.1f} GiB are available; give a length below "
                         f"{fits:,} (or fewer samples)")


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


def check_picture(num_prompt: int, length: int, seq_len: int) -> None:
    """ValueError (one line) unless a picture model's prompt and ``length`` new tokens fit one
    window: the constant 0 and the picture's ``seq_len`` sub-pixels (module docstring)."""
    if num_prompt + length > seq_len + 1:
        raise ValueError(
            f"a picture model reads one picture of {seq_len} sub-pixels after the constant 0 at "
            f"position 0, and its window cannot slide (a later window would read each sub-pixel "
            f"as another row, column or channel): a prompt of {num_prompt} and length={length} "
            f"hold {num_prompt + length} tokens, more than {seq_len + 1}; give at most "
            f"{max(0, seq_len + 1 - num_prompt)} new tokens")


def generate(model, prompt_BP, length: int, *, seed: int = 0, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, keep: int | None = None,
             return_logits: bool = False, image: bool | None = None,
             progress: bool | None = None):
    """Continues each row of ``prompt_BP`` (int [B, P], P >= 1, any P) by ``length`` sampled
    tokens, sliding the window past the context (module docstring; ``keep``: the tokens a new
    window starts with, 1 .. n, default n // 2). Only the last n prompt tokens are read.
    ``image``: whether the model is a picture model, whose window never slides (``length``
    must fit one picture, ``check_picture``); None: a model with the picture's position tables
    (``pos_emb="image"``) is one. ``progress``: a progress bar on stderr; None: for a sample of
    more than ``PROGRESS_WINDOWS`` windows.

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
    check_length(num_prompt, length, batch,
                 4 + (4 * cfg.vocab_size if return_logits else 0))  # int32, float32 logits
    if cfg.pos_emb == "image" if image is None else image:
        check_picture(num_prompt, length, n)
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
    spans = windows(num_prompt, length, n, keep)
    bar = logs.Progress(len(spans), "sample", len(spans) > PROGRESS_WINDOWS
                        if progress is None else progress, unit="window")
    for k, (start, known, end) in enumerate(spans):
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
        bar.update(k + 1, batch * (end - num_prompt), "tokens")
    return (tokens, logits) if return_logits else tokens
