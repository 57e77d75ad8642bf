"""A pattern through the Pallas kernels (``attention.pallas``), fused: each block term of the
pattern in its own layout with its block lists (``attention.blocks``), the terms merged by
their joint log-sum-exp ("terms") or chained, each kernel resuming from the previous term's
partial results ("chained", GPU; with ``gathered``, the fixed pattern's two terms at once in
``attention.pallas_gathered``), and the custom VJP. ``sequence_attention`` is the entry point
(``attention.sparse_attention(..., implementation="pallas")`` calls it); ``sparsity`` says how
many block pairs a pattern visits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from sparse_jax.attention import (
    blocks,
    gathered_plan,
    measured,
    pallas,
    pallas_gathered,
    pallas_onepass,
    patterns,
    tilepath,
    tiles,
)
from sparse_jax.attention.blocks import BlockSizes
from sparse_jax.attention.spec import PatternSpec
from sparse_jax.attention.terms import BandTerm, ColumnTerm, SummaryTerm, TileTerm
from sparse_jax.attention.tiles import NEG as _NEG

# The name of the custom VJP's residuals (q, k, v, the output and its log-sum-exp) for
# ``jax.checkpoint`` policies (``jax.ad_checkpoint.checkpoint_name``).
RESIDUALS = "sparse_attention_residuals"

# ---------------------------------------------------------------------------------------------
# The terms of a pattern, merged; the custom VJP.


def _pad_to(x, length, axis=2):
    if x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths)


def _for_term(compiler, layout):
    """The compiler of one term: the summary term's own tiles where they are set."""
    if layout.kind == "summary" and compiler.summary_q:
        return dataclasses.replace(compiler, block_q=compiler.summary_q,
                                   block_k=compiler.summary_k)
    return compiler


def _terms(spec, rows, compiler):
    """Each term's layout, mask rule, block lists, band plan ((padded length, query-side and
    key-side ``pallas.Band``) where the band kernels run it (``blocks.band_plan``), else None)
    and compiler (``_for_term``)."""
    for term in spec.terms():
        if isinstance(term, TileTerm):  # a user rule's tiles (``tilepath``), if it has any
            layout, keep, lists = tilepath.pallas_term(term, rows, compiler.block_q,
                                                       compiler.block_k)
            if lists.forward[:, :2].any():
                yield layout, keep, lists, None, compiler
            continue
        layout = blocks.term_layout(term, rows)
        comp = _for_term(compiler, layout)
        lists = blocks.block_lists(layout, comp.block_q, comp.block_k)[0]
        band = comp.band and blocks.band_plan(layout, comp.band, comp.band_group,
                                              comp.block_q, comp.block_k)
        yield layout, functools.partial(blocks.keep_rule, layout), lists, band, comp


def _forward(spec, compiler, q, k, v):
    """Output [B, H, n, dv] and joint log-sum-exp [B, H, n] (float32); q pre-scaled by 1/√d."""
    rows = q.shape[2] // spec.block
    outs, lses = [], []
    for layout, keep, lists, band, comp in _terms(spec, rows, compiler):
        if band:
            o, lse = pallas.band_forward(
                comp, band[1], *(_pad_to(layout.queries(x), band[0]) for x in (q, k, v)),
                tag=layout.kind)
            lse = lse.swapaxes(2, 3)  # lane-dense [B, H, 1, N] -> [B, H, N, 1]
        else:
            nq, nk = len(lists.q_attrs[0]), lists.k_attrs[0].shape[1]
            o, lse = pallas.forward(comp, keep, lists,
                                            _pad_to(layout.queries(q), nq),
                                            *(_pad_to(layout.keys(x), nk) for x in (k, v)),
                                            tag=layout.kind)
        outs.append(layout.queries_back(o[:, :, :layout.n]))
        lses.append(layout.queries_back(lse[:, :, :layout.n, 0]))
    lse_max = functools.reduce(jnp.maximum, lses)
    weights = [jnp.exp(lse - lse_max) for lse in lses]
    total = sum(weights)
    out = sum(w[..., None] * o for w, o in zip(weights, outs)) / total[..., None]
    return out, lse_max + jnp.log(total)


def _chain(spec, rows, compiler):
    """The chained variant's plan: the padded grid rows and, per term (the summary term first,
    band terms last, so the last writes sequence-order outputs), its layout, mask rule, block
    lists, compiler and ``pallas.Rows`` of its query and key tiles in sequence-order
    arrays (packed summary keys: their own array). A column term's tile must stay in one
    column: its tiles are cut to ``col``, the largest power of two dividing ``rows`` (at least
    16, at most the tiles), and the rows padded to a multiple of ``col``; and to make every
    tile divide the length. Padding rows are zeros after the sequence: no real query attends
    them, and their zero output gradients add nothing to the real keys' gradients."""
    block = spec.block
    tile = max(compiler.block_q, compiler.block_k, compiler.summary_q, compiler.summary_k)
    step = max(1, tile // (block & -block))  # rows * block a multiple of every tile
    col = min(tile, max(16, rows & -rows))
    terms = sorted(spec.terms(), key=lambda t: [SummaryTerm, ColumnTerm, TileTerm,
                                                BandTerm].index(type(t)))
    if any(isinstance(t, ColumnTerm) for t in terms):
        step = max(step, col)
    rows = -(-rows // step) * step
    plan = []
    for term in terms:
        if isinstance(term, TileTerm):  # sequence order, the kernels' tiles
            at = (pallas.Rows(compiler.block_q), pallas.Rows(compiler.block_k))
            layout, keep, lists = tilepath.pallas_term(term, rows, compiler.block_q,
                                                       compiler.block_k)
            if lists.forward[:, :2].any():
                plan.append((layout, keep, lists, compiler, at))
            continue
        layout = blocks.term_layout(term, rows)
        comp = _for_term(compiler, layout)
        if layout.kind == "columns":
            comp = dataclasses.replace(compiler, block_q=min(compiler.block_q, col),
                                       block_k=min(compiler.block_k, col))
            at = tuple(pallas.Rows(b, block, rows) for b in (comp.block_q,
                                                                      comp.block_k))
        else:
            at = (pallas.Rows(comp.block_q), pallas.Rows(comp.block_k))
        lists = blocks.block_lists(layout, comp.block_q, comp.block_k)[0]
        plan.append((layout, functools.partial(blocks.keep_rule, layout), lists, comp, at))
    return rows * block, plan


def _packed(layout, lists, x, axis):
    """Keys of a term in sequence order, or packed (summary keys) and padded to the tiles."""
    if layout.kind != "summary":
        return x
    return _pad_to(layout.keys(x, axis), lists.k_attrs[0].shape[1], axis)


def _chained_forward(spec, compiler, q, k, v, seq_major=False):
    """``_forward`` of the chained variant: output in q's dtype; arrays [B, n, H, d] and
    log-sum-exp [B, n, H] if ``seq_major``."""
    axis = 1 if seq_major else 2
    n = q.shape[axis]
    gathered = compiler.gathered and gathered_plan.plan(spec, n, compiler)
    if gathered:  # both terms at once (attention.pallas_gathered)
        q, k, v = (_pad_to(x, gathered.length, axis) for x in (q, k, v))
        out, lse = (jax.lax.slice_in_dim(x, 0, n, axis=axis) for x in pallas_gathered.forward(
            compiler, gathered, q, k, v, seq_major))
        return out, lse[..., 0]
    length, plan = _chain(spec, n // spec.block, compiler)
    q, k, v = (_pad_to(x, length, axis) for x in (q, k, v))
    state = ()
    for i, (layout, keep, lists, comp, at) in enumerate(plan):
        state = pallas.forward(
            comp, keep, lists, q, *(_packed(layout, lists, x, axis) for x in (k, v)), rows=at,
            init=state, dtype=q.dtype if i == len(plan) - 1 else jnp.float32,
            seq_major=seq_major, tag=layout.kind)
    out, lse = (jax.lax.slice_in_dim(x, 0, n, axis=axis) for x in state)
    return out, lse[..., 0]


def _chained_backward(spec, compiler, seq_major, q, k, v, do, lse, delta):
    """Gradients of the chained variant, each term's kernels adding to the previous terms'
    (packed summary keys' gradients are put back in sequence order by XLA)."""
    axis = 1 if seq_major else 2
    n = q.shape[axis]
    length, plan = _chain(spec, n // spec.block, compiler)
    q, k, v, do, lse, delta = (_pad_to(x, length, axis) for x in (q, k, v, do, lse, delta))
    dq, dkv = (), ()
    for i, (layout, keep, lists, comp, at) in enumerate(plan):
        last = i == len(plan) - 1
        summary = layout.kind == "summary"
        grads = pallas.backward(
            comp, keep, lists, q, *(_packed(layout, lists, x, axis) for x in (k, v)), do, lse,
            delta, rows=at, init=(dq, () if summary else dkv),
            dtype=q.dtype if last else jnp.float32, seq_major=seq_major, tag=layout.kind)
        dq, dkv = grads[:1], grads[1:]
        if summary:  # the first term (``_chain``'s order): nothing to add to yet
            assert not last
            dkv = tuple(_pad_to(layout.keys_back(jax.lax.slice_in_dim(g, 0, layout.nk, axis=axis),
                                                 axis), length, axis) for g in dkv)
    return tuple(jax.lax.slice_in_dim(g, 0, n, axis=axis) for g in (*dq, *dkv))


def check_onepass(spec: PatternSpec, heads_per_program: int) -> None:
    """ValueError (one line) where the one-pass variant cannot run: a summary term (the fixed
    pattern's), or heads per program (its items are one head each)."""
    for term in spec.terms():
        if isinstance(term, SummaryTerm | TileTerm):
            raise ValueError(f"kernel variant onepass serves band and column terms (strided, "
                             f"local), not {spec}'s {type(term).__name__}: give chained or "
                             "terms")
    if heads_per_program != 1:
        raise ValueError(f"kernel variant onepass walks one head a work item: leave out "
                         f"h{heads_per_program}")


def _onepass(spec, n, compiler):
    """The one-pass variant's plan (``pallas_onepass``): ``_chain``'s, each term as the
    persistent kernels read it (``check_onepass`` first)."""
    check_onepass(spec, compiler.heads_per_program)
    length, plan = _chain(spec, n // spec.block, compiler)
    return length, [(comp, pallas_onepass.Term(keep, lists, *at), layout.kind)
                    for layout, keep, lists, comp, at in plan]


def _onepass_forward(spec, compiler, scale, q, k, v, seq_major=False):
    """``_chained_forward`` on the persistent kernels, q scaled by ``scale`` inside them;
    log-sum-exp [..., 1]."""
    axis = 1 if seq_major else 2
    n = q.shape[axis]
    length, plan = _onepass(spec, n, compiler)
    q, k, v = (_pad_to(x, length, axis) for x in (q, k, v))
    state = ()
    for i, (comp, term, kind) in enumerate(plan):
        state = pallas_onepass.forward(
            comp, term, q, k, v, init=state, scale=scale,
            dtype=q.dtype if i == len(plan) - 1 else jnp.float32, seq_major=seq_major, tag=kind)
    return tuple(jax.lax.slice_in_dim(x, 0, n, axis=axis) for x in state)


def _onepass_backward(spec, compiler, scale, seq_major, q, k, v, out, lse, d_out):
    """Gradients of the one-pass variant: a kernel a term, each adding to the previous term's
    float32 gradients, delta and the empty rows' log-sum-exp handled inside."""
    axis = 1 if seq_major else 2
    n = q.shape[axis]
    length, plan = _onepass(spec, n, compiler)
    q, k, v, out, lse, do = (_pad_to(x, length, axis)
                             for x in (q, k, v, out, lse, d_out.astype(v.dtype)))
    grads = ()
    for i, (comp, term, kind) in enumerate(plan):
        grads = pallas_onepass.backward(
            comp, term, q, k, v, out, do, lse, init=grads, scale=scale,
            dtype=q.dtype if i == len(plan) - 1 else jnp.float32, seq_major=seq_major, tag=kind)
    return tuple(jax.lax.slice_in_dim(g, 0, n, axis=axis) for g in grads)


def _gathered_backward(plan, compiler, seq_major, q, k, v, out, do, lse):
    """Gradients through ``pallas_gathered`` (both terms of the fixed pattern at once)."""
    axis = 1 if seq_major else 2
    n = q.shape[axis]
    grads = pallas_gathered.backward(
        compiler, plan, *(_pad_to(x, plan.length, axis) for x in (q, k, v, out, do,
                                                                  lse[..., None])), seq_major)
    return tuple(jax.lax.slice_in_dim(g, 0, n, axis=axis) for g in grads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _attention(spec, compiler, variant, seq_major, q, k, v):
    return _attention_fwd(spec, compiler, variant, seq_major, q, k, v)[0]


def _attention_fwd(spec, compiler, variant, seq_major, q, k, v):
    if variant == "chained":
        out, lse = _chained_forward(spec, compiler, q, k, v, seq_major)
    else:
        out, lse = _forward(spec, compiler, q, k, v)
    # named, so that a remat policy can keep them (the model's remat="attention"): the backward
    # then needs no second forward pass; the output too, or the primal output would be
    # recomputed for the layers above (the names change no value)
    q, k, v, out, lse = (checkpoint_name(x, RESIDUALS) for x in (q, k, v, out, lse))
    return out, (q, k, v, out, lse)


def _attention_bwd(spec, compiler, variant, seq_major, residuals, d_out):
    q, k, v, out, lse = residuals
    gathered = variant == "chained" and compiler.gathered and gathered_plan.plan(
        spec, q.shape[1 if seq_major else 2], compiler)
    if gathered:  # delta and the log-sum-exp's fix in the dq program
        return _gathered_backward(gathered, compiler, seq_major, q, k, v, out,
                                  d_out.astype(v.dtype), lse)
    delta = (d_out.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1, keepdims=True)
    lse = jnp.where(lse > _NEG / 2, lse, -_NEG)[..., None]  # no key: every probability 0
    do = d_out.astype(v.dtype)
    if variant == "chained":
        return _chained_backward(spec, compiler, seq_major, q, k, v, do, lse, delta)
    rows = q.shape[2] // spec.block
    grads = [jnp.zeros(x.shape, jnp.float32) for x in (q, k, v)]
    for layout, keep, lists, band, comp in _terms(spec, rows, compiler):
        nq, nk = (band[0], band[0]) if band else (len(lists.q_attrs[0]),
                                                  lists.k_attrs[0].shape[1])
        q_l, do_l, lse_l, delta_l = (_pad_to(layout.queries(x), nq) for x in (q, do, lse, delta))
        k_l, v_l = (_pad_to(layout.keys(x), nk) for x in (k, v))
        if band:
            dq, dk, dv = pallas.band_backward(
                comp, band[1:], q_l, k_l, v_l, do_l, lse_l.swapaxes(2, 3),
                delta_l.swapaxes(2, 3), tag=layout.kind)
        else:
            dq, dk, dv = pallas.backward(comp, keep, lists, q_l, k_l, v_l, do_l,
                                                 lse_l, delta_l, tag=layout.kind)
        grads[0] += layout.queries_back(dq[:, :, :layout.n])
        grads[1] += layout.keys_back(dk[:, :, :layout.nk])
        grads[2] += layout.keys_back(dv[:, :, :layout.nk])
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _onepass_attention(spec, compiler, scale, seq_major, q, k, v):
    """The one-pass variant, q scaled inside its kernels (no XLA kernel scales q or dq)."""
    return _onepass_fwd(spec, compiler, scale, seq_major, q, k, v)[0]


def _onepass_fwd(spec, compiler, scale, seq_major, q, k, v):
    out, lse = _onepass_forward(spec, compiler, scale, q, k, v, seq_major)
    q, k, v, out, lse = (checkpoint_name(x, RESIDUALS) for x in (q, k, v, out, lse))  # remat
    return out, (q, k, v, out, lse)


def _onepass_bwd(spec, compiler, scale, seq_major, residuals, d_out):
    return _onepass_backward(spec, compiler, scale, seq_major, *residuals, d_out)


_onepass_attention.defvjp(_onepass_fwd, _onepass_bwd)


def _pad_head(x, backend):
    """Zero-pad the head dimension (exact for q·k and v) to Triton's power-of-two tiles."""
    if backend != "triton":
        return x
    return _pad_to(x, max(16, pl.next_power_of_2(x.shape[-1])), axis=3)


def _target(backend: str | None, interpret: bool | None) -> tuple[str, bool]:
    """(backend, interpret) with their defaults: "mosaic" on a TPU, else "triton"; compiled on
    the backend's own platform (``tiles.target_platform``) and interpreted elsewhere."""
    platform = tiles.target_platform()
    backend = backend or ("mosaic" if platform == "tpu" else "triton")
    patterns.check_choice("backend", backend, tiles.BACKENDS)
    if interpret is None:
        interpret = platform != {"triton": "gpu", "mosaic": "tpu"}[backend]
    return backend, interpret


def compiler_for(sizes: BlockSizes | None = None, backend: str | None = None,
                 interpret: bool | None = None) -> pallas.Compiler:
    """How to build the kernels here: ``backend`` "triton" or "mosaic" (default: "mosaic" on
    a TPU, else "triton"), compiled on its own platform and interpreted elsewhere (default; the
    platform is ``tiles.target_platform``, this process's unless ``compiling_for``),
    ``sizes`` default ``BlockSizes.for_backend``."""
    backend, interpret = _target(backend, interpret)
    sizes = sizes or BlockSizes.for_backend(backend)
    sizes.check_backend(backend, tiles=not interpret)
    return pallas.Compiler(backend, interpret, sizes.block_q, sizes.block_k,
                                   sizes.num_warps, sizes.num_stages, sizes.heads_per_program,
                                   sizes.one_loop, sizes.band if backend == "mosaic" else 0,
                                   sizes.band_group, sizes.summary_q, sizes.summary_k,
                                   sizes.gathered, sizes.dkv, sizes.atomic_dq)


def sequence_attention(spec: PatternSpec, q, k, v, *, sizes: BlockSizes | None = None,
                       backend: str | None = None, interpret: bool | None = None,
                       return_lse: bool = False, seq_major: bool = False,
                       scale: float | None = None):
    """``softmax(q kᵀ + mask) v`` for the pattern on arrays [B, H, n, d] ([B, n, H, d] if
    ``seq_major``) with n a multiple of ``spec.block`` and q already scaled by 1/√d; returns
    the output like v (differentiable), float32 for ``sizes.variant`` "terms" and q's dtype for
    "chained", or with ``return_lse`` also the log-sum-exp of each row's kept scores [B, H, n]
    ([B, n, H]; a row with no key: -1e30; not differentiable). The chained variant reads
    ``seq_major`` arrays as they are; "terms" transposes them. ``sizes``, ``backend``,
    ``interpret``: ``compiler_for``, except that ``sizes`` None on a GPU is the options measured
    fastest for the pattern at this length (``attention.measured``). ``scale``: q not yet
    scaled, scale it by this (inside the kernels for the "onepass" variant, which then returns
    [B, n, H]-like arrays as "chained" does).
    """
    if sizes is None:  # the options measured fastest for this pattern and length (GPU)
        sizes = measured.default_sizes(*_target(backend, interpret), spec.kind,
                                       q.shape[1 if seq_major else 2])
    compiler = compiler_for(sizes, backend, interpret)
    variant = sizes.variant
    heads = q.shape[2 if seq_major else 1]
    if heads % compiler.heads_per_program:
        raise ValueError(f"BlockSizes.heads_per_program={compiler.heads_per_program} must "
                         f"divide the {heads} heads")
    if seq_major and variant == "terms":  # the terms' layouts start from [B, H, n, d]
        swap = lambda x: x.swapaxes(1, 2)  # noqa: E731
        out = sequence_attention(spec, *map(swap, (q, k, v)), sizes=sizes, backend=backend,
                                 interpret=interpret, return_lse=return_lse, scale=scale)
        return tuple(map(swap, out)) if return_lse else swap(out)
    dv = v.shape[-1]
    if scale is not None and variant != "onepass":
        q, scale = q * jnp.asarray(scale, q.dtype), None
    q, k, v = (_pad_head(x, compiler.backend) for x in (q, k, v))
    if variant == "onepass":
        if return_lse:
            out, lse = _onepass_forward(spec, compiler, scale, q, k, v, seq_major)
            return out[..., :dv], lse[..., 0]
        return _onepass_attention(spec, compiler, scale, seq_major, q, k, v)[..., :dv]
    if return_lse:
        if variant == "chained":
            out, lse = _chained_forward(spec, compiler, q, k, v, seq_major)
        else:
            out, lse = _forward(spec, compiler, q, k, v)
        return out[..., :dv], lse
    return _attention(spec, compiler, variant, seq_major, q, k, v)[..., :dv]


def sparsity(spec: PatternSpec, seq_len: int, sizes: BlockSizes | None = None) -> dict:
    """Kept and scored (query, key) pairs of the kernel's block lists at ``seq_len`` (padded to
    the grid) for tiles ``sizes`` (default: the GPU's 64 × 64; with ``sizes.band``, a term the
    band kernels run scores its query blocks' whole windows): ``kept / scored`` is the share
    of tile work that is useful."""
    sizes = sizes or BlockSizes()
    rows = -(-seq_len // spec.block)
    kept = scored = 0
    for term in spec.terms():
        if isinstance(term, TileTerm):
            counts = tilepath.tile_counts(term, rows * spec.block, sizes.block_q, sizes.block_k)
            kept, scored = kept + int(counts.sum()), scored + int(
                (counts > 0).sum()) * sizes.block_q * sizes.block_k
            continue
        layout = blocks.term_layout(term, rows)
        bq, bk = ((sizes.summary_q, sizes.summary_k) if layout.kind == "summary"
                  and sizes.summary_q else (sizes.block_q, sizes.block_k))
        _, term_kept, term_scored = blocks.block_lists(layout, bq, bk)
        band = sizes.band and blocks.band_plan(layout, sizes.band, sizes.band_group, bq, bk)
        if band:
            term_scored = band[0] * sizes.band * band[1].width
        kept, scored = kept + term_kept, scored + term_scored
    return {"kept": kept, "scored": scored}
