"""The work of a compiled attention program's Triton kernels, from the host's plan of its tiles
(``compiled.build_program`` puts it beside the compiler's registers and spills): per kernel its
programs, the key tiles each walks (mean and most), its tile shape and its HBM bytes, for the
list-walking variants (terms, chained), the one-pass kernels (``attention.pallas_onepass``) and
the fixed pattern's gathered kernels (``attention.pallas_gathered``).
"""

from __future__ import annotations

import dataclasses


def tile_work(spec, n: int, sizes, heads: int, head_dim: int, dtype_bytes: int = 2,
              batch: int = 1) -> dict:
    """Per kernel name (``sparse_{forward,dq,dkv}_{kind}``): the key (or query) tiles each
    program visits (mean, max), its programs, its tiles (``block_q`` queries by ``block_k``
    keys) and an estimate of the HBM bytes it moves (own tiles in, listed tiles in per visit,
    outputs out; float32 partial results; no reuse through L2), for ``batch`` sequences of
    ``heads`` heads (a batch row: more programs of the same walks, or on the one-pass kernels'
    persistent grid more items a program)."""
    from sparse_jax.attention import fused, gathered_plan, measured

    # no options: the kernel compiles with the GPU's defaults chosen by measurement
    sizes = sizes or measured.default_sizes("triton", False, spec.kind, n)
    sizes = dataclasses.replace(sizes, band=0)  # band kernels: a TPU's alone
    compiler = fused.compiler_for(sizes, "triton", interpret=False)
    if sizes.variant == "onepass":
        return onepass_work(spec, n, compiler, heads, head_dim, dtype_bytes, batch)
    rows = -(-n // spec.block)
    chained = sizes.variant == "chained"
    gathered = compiler.gathered and gathered_plan.plan(spec, n, compiler)
    if gathered:
        return gathered_work(gathered, batch * heads // compiler.heads_per_program,
                             batch * heads, max(16, 1 << (head_dim - 1).bit_length()),
                             dtype_bytes)
    if chained:
        _, plan = fused._chain(spec, rows, compiler)
        terms = [(layout, lists, comp) for layout, _, lists, comp, _ in plan]
    else:
        terms = [(layout, lists, comp) for layout, _, lists, _, comp in
                 fused._terms(spec, rows, compiler)]
    d = max(16, 1 << (head_dim - 1).bit_length())
    h = compiler.heads_per_program
    groups = batch * heads // h
    out = {}
    for index, (layout, lists, comp) in enumerate(terms):
        bq, bk = comp.block_q, comp.block_k
        last, resume = chained and index == len(terms) - 1, chained and index > 0
        out_bytes = dtype_bytes if last else 4
        for name, table, own, listed in (("forward", lists.forward, bq, bk),
                                         ("dq", lists.forward, bq, bk),
                                         ("dkv", lists.backward, bk, bq)):
            visits = table[:, 0] + table[:, 1]
            tiles = int(visits.sum())
            if name == "forward":  # q own; k, v listed; o, lse out
                own_in, per_visit = own * d * dtype_bytes, 2 * listed * d * dtype_bytes
                own_out = own * d * out_bytes + own * 4
            elif name == "dq":  # q, do, lse, delta own; k, v listed; dq out
                own_in, per_visit = 2 * own * d * dtype_bytes + 2 * own * 4, \
                    2 * listed * d * dtype_bytes
                own_out = own * d * out_bytes
            else:  # k, v own; q, do, lse, delta listed; dk, dv out
                own_in = 2 * own * d * dtype_bytes
                per_visit = 2 * listed * d * dtype_bytes + 2 * listed * 4
                own_out = 2 * own * d * out_bytes
            resume_in = (own_out * 4 // out_bytes) if resume and not (
                name == "dkv" and layout.kind == "summary") else 0
            per_head = len(visits) * (own_in + own_out + resume_in) + tiles * per_visit
            out[f"sparse_{name}_{layout.kind}"] = {
                "tiles_mean": float(visits.mean()), "tiles_max": int(visits.max()),
                "programs": int(len(visits) * groups),
                "hbm_bytes": int(per_head * heads * batch),
                "block_q": bq, "block_k": bk}
    return out


def onepass_work(spec, n: int, compiler, heads: int, head_dim: int, dtype_bytes: int,
                 batch: int = 1) -> dict:
    """``tile_work`` of the one-pass kernels (``pallas_onepass``): per kernel its programs (a
    grid of resident slots), the key tiles each walks over its items (an item: a tile of one
    head; program p takes items p, p + P, ...), the backward's dq and dk/dv items together
    (``products``: matrix products a tile, their mean), or with ``atomic_dq`` its dk/dv items
    alone (5 products a tile, dq read and written at each); bytes as ``tile_work``'s. A tile's
    items are its ``batch`` × ``heads`` neighbours (``pallas_onepass._split``)."""
    import numpy as np

    from sparse_jax.attention import fused, pallas_onepass

    d, b = max(16, 1 << (head_dim - 1).bit_length()), dtype_bytes
    heads *= batch  # the items of a tile: every batch row's heads
    _, plan = fused._onepass(spec, n, compiler)
    out = {}
    for index, (comp, term, kind) in enumerate(plan):
        o = b if index == len(plan) - 1 else 4  # the output's bytes an element
        r = 4 / o if index else 0  # partial results read back, float32
        bq, bk = term.own_q.block, term.own_k.block
        fwd = term.lists.forward[:, 0] + term.lists.forward[:, 1]
        bwd = term.lists.backward[:, 0] + term.lists.backward[:, 1]
        passes = {  # (visits, products a tile, bytes an item, bytes a visit) of each kind
            "forward": [(fwd, 2, bq * (d * b + (d * o + 4) * (1 + r)), 2 * bk * d * b)],
            "backward": [(fwd, 3, bq * (3 * d * b + 4 + d * o * (1 + r)), 2 * bk * d * b),
                         (bwd, 4, bk * 2 * d * (b + o * (1 + r)), bq * (3 * d * b + 4))]}
        if comp.atomic_dq:  # dk/dv items alone, each visit adding ds k to dq (float32)
            passes["backward"] = [(bwd, 5, bk * 2 * d * (b + o * (1 + r)),
                                   bq * (3 * d * b + 4 + 2 * d * 4))]
        for name, kinds in passes.items():
            items = np.concatenate([np.repeat(v, heads) for v, *_ in kinds])
            grid = pallas_onepass.programs(comp, name, len(items))
            walk = np.bincount(np.arange(len(items)) % grid, weights=items, minlength=grid)
            tiles = [int(v.sum()) * heads for v, *_ in kinds]
            out[f"sparse_{name}_onepass_{kind}"] = {
                "tiles_mean": float(walk.mean()), "tiles_max": int(walk.max()),
                "programs": grid, "items": len(items), "block_q": bq, "block_k": bk,
                "products": sum(k[1] * t for k, t in zip(kinds, tiles)) / sum(tiles),
                "hbm_bytes": int(sum(len(v) * heads * item + t * visit
                                     for (v, _, item, visit), t in zip(kinds, tiles)))}
    return out


def gathered_work(plan, groups: int, heads: int, d: int, dtype_bytes: int) -> dict:
    """``tile_work`` of the gathered kernels (``attention.pallas_gathered``): tiles from
    ``gathered_plan.tables``; bytes as there, the gathered k and v side by side (2d columns)
    read per visit, the gathered dk and dv written in float32 and read back by the band's
    dk/dv. With ``plan.atomic`` no dq kernel, and each dk/dv visit adds ``ds k`` to dq (5
    products a tile; its float32 rows read and written there)."""
    from sparse_jax.attention import gathered_plan

    dkv = plan.for_dkv()
    stats = 2 * 4  # log-sum-exp and delta, float32, per query
    row = 2 * d * dtype_bytes  # a query's q and dO, or a key's k and v
    # (own tile in, out, per visit, block_q, block_k) per kernel
    shape = {"sparse_forward_gathered": (plan.bq * d * dtype_bytes, plan.bq * (
                 d * dtype_bytes + 4), plan.bk * row, plan.bq, plan.bk),
             "sparse_dq_gathered": (plan.bq * (row + stats), plan.bq * d * dtype_bytes,
                                    plan.bk * row, plan.bq, plan.bk),
             "sparse_dkv_gathered": (dkv.bk * row, dkv.bk * 2 * d * 4,
                                     dkv.bq * (row + stats), dkv.bq, dkv.bk),
             "sparse_dkv_gathered_band": (plan.band_k * (row + 2 * d * 4 * len(plan.runs())),
                                          plan.band_k * row, plan.band_q * (row + stats),
                                          plan.band_q, plan.band_k)}
    out = {}
    for name, table in gathered_plan.tables(plan).items():
        own_in, own_out, per_visit, bq, bk = shape[name]
        atomic = plan.atomic and "dkv" in name
        if plan.atomic and "dq" in name:
            continue
        visits = table[:, 0] + table[:, 1]
        per_visit += 2 * bq * d * 4 if atomic else 0
        out[name] = {"tiles_mean": float(visits.mean()), "tiles_max": int(visits.max()),
                     "programs": int(len(visits) * groups),
                     "hbm_bytes": int((len(visits) * (own_in + own_out)
                                       + int(visits.sum()) * per_visit) * heads),
                     "block_q": bq, "block_k": bk, **({"products": 5} if atomic else {})}
    return out
