"""Where a trained model looks: the attention of every layer and head, from a checkpoint.

  python scripts/attention_stats.py --workdir=DIR [--split=test] [--windows=4] [--layers=0,5]
      [--heads=0,1] [--bands=64,512,4096] [--far=N] [--queries="16,16,0;8,30,2"]

`attention_stats` runs W held-out windows of a split (evenly spaced over it; each query weighted
by the evaluation mask, so no byte counts twice) through a checkpoint's model and sums, for
every layer and head, the attention weight at each key distance i - j (0: the query itself).
It reports the mass in distance bands (0, 1-64, 65-512, 513-4,096, 4,097-16,384 and the rest:
those the context allows) and beyond ``far``; the mass on each term of the head's pattern
(``attention.weights.term_names``: the "local" window, the strided "column", fixed's "block" and
"summary" keys, "all" for dense); the mean and 90th percentile of the distance (of the weights
pooled over the queries); the entropy of a query's weights (bits, the mean over queries);
a curve of the mass by distance (4 buckets per doubling); and beside them ("uniform") what a
head spreading its weight evenly over its pattern's keys would give: the chance level.

The weights are the model's own: the blocks run one at a time, each layer's input goes through
its attention's ``project`` (projections, rotary, shifted keys and values), and
``attention.weights`` scores the queries, a block at a time, against exactly the keys their
pattern gives them (the sets training attends), as the kernels score them, with one softmax over
all of a query's keys, summed into per-head histograms of exact distance: no n x n array. A
shifted head's distance is its key's slot (it reads the key of j - s there; each head's shift is
in the result). A run trained with its sequences split over devices (mesh.seq) is read
unsplit, on one device. For picture models ``queries`` draws the paper's Figure 2: the weights
of a few query sub-pixels over the picture, per layer (or head).

Output: WORKDIR/attention/<split>_<step>.{json,md,png} (``output_dir``; the PNG: layers x heads
coloured by far mass, beside each layer's mass at distance >= d) and <split>_<step>_figure2.png.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax.attention.weights import Sums, layer_sums, query_weights, term_names
from sparse_jax.data import datasets as data_lib
from sparse_jax.evaluate import position_edges
from sparse_jax.files import atomic_write, write_error
from sparse_jax.logs import Progress
from sparse_jax.run import checkpoints, setup
from sparse_jax.run import workdir as workdir_lib

BAND_EDGES = (64, 512, 4096, 16384)  # the bands' default upper distances
CURVE_PER_OCTAVE = 4


# ---------------------------------------------------------------------------------------------
# Through a model.


def model_blocks(model) -> list:
    """The model's residual blocks in order (scanned layers unstacked)."""
    cfg = model.cfg
    if not cfg.scan_layers:
        return list(model.blocks)
    graphdef, stacked = nnx.split(model.block_groups)
    return [block for g in range(cfg.num_layers // cfg.period) for block in nnx.merge(
        graphdef, jax.tree.map(lambda x: x[g], stacked)).blocks]  # noqa: B023


@nnx.jit(static_argnames=("stats", "positions"))
def _layer(block, h_BND, w_BN, stats: bool, positions: tuple):
    """(the block's output, its ``Sums`` or None, Figure 2's weights or None)."""
    q, k, _ = block.attn.project(block.attn_norm(h_BND))
    sums = layer_sums(q, k, block.attn.specs, w_BN) if stats else None
    rows = query_weights(q[:1], k[:1], block.attn.specs, positions) if positions else None
    return block(h_BND), sums, rows


_embed = nnx.jit(lambda model, tokens_BN: model.embed(tokens_BN))


@functools.partial(jax.jit, static_argnames="specs")
def _uniform(specs, w_BN) -> Sums:
    """``Sums`` of one head per group of ``specs`` whose weight is spread evenly over its keys
    (every score 0): what the mass by distance would be without any preference."""
    zeros = jnp.zeros((*w_BN.shape, len(specs), 1))
    return layer_sums(zeros, zeros, specs, w_BN)


def model_sums(model, tokens_BN, w_BN, layers, positions=(), on_layer=None):
    """({layer: Sums}, {layer: Figure 2's weights [H, P, n] of the first window}) of the
    ``layers`` (ascending) for windows ``tokens`` weighted by ``w``, the blocks run one at a
    time; ``on_layer()`` after each."""
    h = _embed(model, jnp.asarray(tokens_BN))
    sums, rows = {}, {}
    for k, block in enumerate(model_blocks(model)[:max(layers) + 1]):
        h, s, r = _layer(block, h, jnp.asarray(w_BN), k in layers,
                         tuple(positions) if k in layers else ())
        if k in layers:
            sums[k] = jax.device_get(s)
            if positions:
                rows[k] = np.asarray(r[0])
        if on_layer is not None:
            on_layer()
    return sums, rows


# ---------------------------------------------------------------------------------------------
# What is asked for, checked before any work.


def bands_for(n: int, edges=None) -> list[tuple[int, int]]:
    """[(first, last)] distance bands: 0 alone, then up to each edge, then to n - 1. ``edges``:
    increasing distances in [1, n - 1] (default ``BAND_EDGES`` below n - 1); ValueError else."""
    if edges is None:
        edges = [e for e in BAND_EDGES if e < n - 1]
    for e in (edges := list(edges)):
        if isinstance(e, bool) or not isinstance(e, (int, np.integer)) or e < 1:
            raise ValueError(f"--bands: band edges are distances >= 1, got {e!r}")
        if e > n - 1:
            raise ValueError(f"--bands: a band up to {e:,} lies beyond the context: distances "
                             f"run 0-{n - 1:,} (seq_len={n:,})")
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"--bands: band edges must increase, got {edges}")
    bounds = [0, *edges, n - 1]
    return [(0, 0)] + [(a + 1, b) for a, b in zip(bounds, bounds[1:]) if a + 1 <= b]


def default_far(n: int) -> int:
    """The largest ``BAND_EDGES`` distance <= n / 4 (n / 4 below 256): far mass lies beyond it."""
    return max([e for e in BAND_EDGES if e <= n // 4], default=n // 4)


def _selection(flag: str, chosen, count: int, what: str) -> tuple[int, ...]:
    if chosen is None:
        return tuple(range(count))
    chosen = tuple(chosen)
    bad = [c for c in chosen if isinstance(c, bool) or not isinstance(c, (int, np.integer))
           or not 0 <= c < count]
    if not chosen or bad:
        raise ValueError(f"--{flag}: {what} {bad[0] if bad else 'list is empty'} does not exist:"
                         f" the model has {count} {what}s (0-{count - 1})")
    return tuple(sorted(set(int(c) for c in chosen)))


def query_positions(queries, image_shape) -> tuple[int, ...]:
    """Sequence positions of Figure 2's query sub-pixels (row, column[, channel]; channel 0 if
    left out) of a picture of ``image_shape`` (None: not a picture model)."""
    if not queries:
        return ()
    if image_shape is None:
        raise ValueError("--queries: Figure 2 draws a picture model's attention; this run "
                         "models bytes")
    rows, cols, channels = image_shape
    out = []
    for query in queries:
        r, c, ch = (*query, 0) if len(query) == 2 else tuple(query)
        if not (0 <= r < rows and 0 <= c < cols and 0 <= ch < channels):
            raise ValueError(f"--queries: {tuple(query)} lies outside the picture: rows 0-"
                             f"{rows - 1}, columns 0-{cols - 1}, channels 0-{channels - 1}")
        out.append((r * cols + c) * channels + ch)
    return tuple(out)


def output_paths(folder: str, split: str, step: int, figure: bool) -> dict[str, str]:
    base = os.path.join(folder, f"{split}_{step}")
    paths = {k: f"{base}.{k}" for k in ("png", "md", "json")}
    return {**({"figure2": f"{base}_figure2.png"} if figure else {}), **paths}


def held_out_windows(dataset, split: str, windows: int):
    """(inputs [W, n], weights [W, n], targets [W, n]) of W windows evenly spaced over the split's
    evaluation windows (or images); weights: the evaluation mask."""
    count = dataset.num_sequences(split)
    if windows > count:
        raise ValueError(f"--windows={windows}: the {split} split holds {count} "
                         f"{'images' if dataset.items == 'images' else 'windows'}; ask for at "
                         f"most {count}")
    rows = [b for _, b in zip(range(windows), dataset.eval_batches(split, count // windows))]
    return tuple(np.stack([b[key][0] for b in rows]) for key in ("inputs", "mask", "targets"))


# ---------------------------------------------------------------------------------------------
# The statistics of a run.


def head_stats(hist, terms, names, entropy, weight, bands, far) -> dict:
    """One head's figures from its sums (``Sums``' rows, summed over windows)."""
    mass = np.asarray(hist, np.float64) / weight
    cum = np.cumsum(mass)
    edges = position_edges(len(mass), CURVE_PER_OCTAVE)
    return {"bands": [float(mass[a:b + 1].sum()) for a, b in bands],
            "far": float(mass[far + 1:].sum()),
            "terms": {name: float(m) / weight for name, m in zip(names, terms)},
            "mean_distance": float(mass @ np.arange(len(mass))),
            "p90_distance": int(np.searchsorted(cum, 0.9 * cum[-1])),
            "entropy_bits": float(entropy) / weight,
            "curve": [float(mass[a:b].sum()) for a, b in zip(edges, edges[1:])]}


def check_arguments(workdir: str, split: str = "test", checkpoint="latest", windows: int = 4, *,
                    layers=None, heads=None, bands=None, far: int | None = None, queries=None,
                    attention: str | None = None, output_dir: str | None = None,
                    overwrite: bool = False, write: bool = True) -> dict:
    """``attention_stats``' arguments checked against the run (ValueError, one line) before any
    data is read or parameter restored; returns what it needs of them."""
    workdir_lib.check_workdir(workdir)
    checkpoint = checkpoints.parse_checkpoint(checkpoint)
    if split not in data_lib.SPLITS:
        raise ValueError(f"split must be one of {data_lib.SPLITS}, got {split!r}")
    config, cfg = setup.recorded(workdir, attention)
    n = cfg.seq_len
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise ValueError(f"--windows must be a positive number of windows, got {windows!r}")
    layers = _selection("layers", layers, cfg.num_layers, "layer")
    per_head, heads = heads is not None, _selection("heads", heads, cfg.num_heads, "head")
    band_list = bands_for(n, bands)
    far = default_far(n) if far is None else far
    if isinstance(far, bool) or not isinstance(far, int) or not 0 <= far <= n - 2:
        raise ValueError(f"--far={far!r} lies beyond the context: far mass is beyond a distance"
                         f" in 0-{n - 2:,} (seq_len={n:,})")
    image = data_lib.data_config(config.data).is_image
    positions = query_positions(queries, cfg.image_shape if image else None)
    folder = output_dir or os.path.join(workdir, "attention")
    checked = dict(config=config, cfg=cfg, checkpoint=checkpoint, layers=layers, heads=heads,
                   per_head=per_head, band_list=band_list, far=far, positions=positions,
                   folder=folder)
    _check_outputs(checked, split, checkpoints.step_of(workdir, checkpoint), write, overwrite)
    return checked


def _check_outputs(checked: dict, split: str, step: int, write: bool, overwrite: bool) -> None:
    paths = output_paths(checked["folder"], split, step, bool(checked["positions"]))
    for path in paths.values() if write else ():
        workdir_lib.check_output(path, overwrite, create=False)


def attention_stats(workdir: str, split: str = "test", checkpoint="latest", windows: int = 4, *,
                    layers=None, heads=None, bands=None, far: int | None = None, queries=None,
                    attention: str | None = None, output_dir: str | None = None,
                    overwrite: bool = False, write: bool = True, progress: bool = True) -> dict:
    """The statistics of the module docstring for one checkpoint; returns the result (written
    to ``output_paths`` if ``write``; existing files are replaced only with ``overwrite``).
    layers, heads: which to report (default all); bands: the band edges (``bands_for``); far:
    the distance beyond which mass is far (``default_far``); queries: Figure 2's query
    sub-pixels (row, column[, channel]) of a picture model. Bad input raises one line before
    any parameter is restored (``check_arguments``)."""
    checked = check_arguments(workdir, split, checkpoint, windows, layers=layers, heads=heads,
                              bands=bands, far=far, queries=queries, attention=attention,
                              output_dir=output_dir, overwrite=overwrite, write=write)
    config, cfg, checkpoint = checked["config"], checked["cfg"], checked["checkpoint"]
    layers, heads, per_head = checked["layers"], checked["heads"], checked["per_head"]
    band_list, far, positions = checked["band_list"], checked["far"], checked["positions"]
    folder, n = checked["folder"], cfg.seq_len
    dataset = data_lib.make_dataset(config.data, n, vocab_size=cfg.vocab_size,
                                    image_shape=cfg.image_shape, training=False)
    dataset.check_split(split)
    tokens, weights, targets = held_out_windows(dataset, split, windows)
    workdir_lib.check_data(workdir, config.data, dataset, record=False)
    model, config, step = checkpoints.restore_model(workdir, checkpoint, None, cfg.attention)
    _check_outputs(checked, split, step, write, overwrite)  # a damaged checkpoint: another step

    bar = Progress(windows * (max(layers) + 1), f"attention of {split} step {step}", progress,
                   unit="layer")
    done, start, totals, figure = [0], time.time(), {}, None

    def on_layer():
        done[0] += 1
        bar.update(done[0], done[0] * n, "queries")

    for w in range(windows):  # float64 sums over the windows, one window at a time
        sums, rows = model_sums(model, tokens[w:w + 1], weights[w:w + 1], layers, positions,
                                on_layer)
        figure = rows if w == 0 else figure
        totals = {k: Sums(*(np.asarray(x, np.float64) + totals.get(k, (0,) * 4)[i]
                            for i, x in enumerate(s))) for k, s in sums.items()}
    result = {"workdir": os.path.abspath(workdir), "split": split, "step": int(step),
              "windows": windows, "queries": float(totals[layers[0]].weight), "seq_len": n,
              "unit": dataset.unit, "dataset": config.data.name,
              "model": {k: getattr(cfg, k) for k in (
                  "num_layers", "num_heads", "pattern", "stride", "c", "local_width", "mode",
                  "schedule", "rotary", "rotary_fraction", "shifted_heads", "pos_emb")},
              "mesh_seq": int(config.mesh.get("seq", 1)), "devices": 1,
              "backend": jax.default_backend(), "bands": [list(b) for b in band_list],
              "far": far, "curve_edges": position_edges(n, CURVE_PER_OCTAVE),
              "wall_s": time.time() - start, "layers": []}
    uniform = {}  # {specs: Sums} of heads spreading their weight evenly over their keys
    for k in layers:
        specs, s = cfg.layer_specs(k), totals[k]
        shifts = cfg.head_shifts(k) or (0,) * cfg.num_heads
        group = [h * len(specs) // cfg.num_heads for h in range(cfg.num_heads)]
        u = uniform.setdefault(specs, jax.device_get(_uniform(specs, jnp.asarray(weights))))
        result["layers"].append({"layer": k, "heads": [
            {"head": h, "pattern": str(specs[group[h]]), "shift": shifts[h], **head_stats(
                s.hist[h], s.terms[h], term_names(specs[group[h]]), s.entropy[h], s.weight,
                band_list, far), "uniform": {key: v for key, v in head_stats(
                    u.hist[group[h]], u.terms[group[h]], term_names(specs[group[h]]),
                    u.entropy[group[h]], float(u.weight), band_list, far).items()
                    if key != "curve"}} for h in heads]})
    if write:
        paths = output_paths(folder, split, step, bool(positions))
        try:
            os.makedirs(folder, exist_ok=True)
            plot_stats(result, paths["png"])
            if positions:
                plot_figure2(figure, targets[0], cfg.image_shape, queries, positions, heads
                             if per_head else None, paths["figure2"])
            with atomic_write(paths["md"]) as f:
                f.write(format_table(result) + "\n")
            with atomic_write(paths["json"]) as f:  # the JSON last: whole results or none
                json.dump(result, f, indent=1)
        except OSError as e:
            raise write_error(paths["json"], e, "free some space or choose another output") \
                from e
        result["paths"] = paths
    return result


def far_by_layer(result: dict, edges) -> dict[str, dict[str, list[float]]]:
    """{edge: {"mean", "max", "uniform": [per layer]}}: each reported layer's attention mass
    beyond each of ``edges`` that is a band edge of ``result`` (the others, at or past the
    context's end, are left out): the mean over its heads, the largest head's, and the mean
    of its heads spreading their weight evenly (the chance level)."""
    starts, far = [a for a, _ in result["bands"]], {}
    for e in (e for e in edges if e + 1 in starts):
        beyond = [[[sum(m for a, m in zip(starts, x["bands"]) if a > e) for x in (h, h["uniform"])]
                   for h in layer["heads"]] for layer in result["layers"]]
        far[str(e)] = {"mean": [float(np.mean([m for m, _ in b])) for b in beyond],
                       "max": [max(m for m, _ in b) for b in beyond],
                       "uniform": [float(np.mean([u for _, u in b])) for b in beyond]}
    return far


# ---------------------------------------------------------------------------------------------
# Tables and pictures.


def format_table(result: dict) -> str:
    """Markdown: one row per layer and head."""
    bands = result["bands"]
    head = ["layer", "head", "pattern", *(f"{a:,}" + (f"–{b:,}" if b > a else "")
                                          for a, b in bands),
            f"> {result['far']:,}", "(uniform)", "mean d", "p90 d", "entropy bits (uniform)",
            "by term"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for layer in result["layers"]:
        for h in layer["heads"]:
            shift = f", shift {h['shift']}" if h["shift"] else ""
            terms = ", ".join(f"{k} {v:.3f}" for k, v in h["terms"].items())
            cells = [str(layer["layer"]), str(h["head"]), h["pattern"] + shift,
                     *(f"{m:.3f}" for m in h["bands"]), f"{h['far']:.4f}",
                     f"{h['uniform']['far']:.4f}", f"{h['mean_distance']:,.1f}",
                     f"{h['p90_distance']:,}",
                     f"{h['entropy_bits']:.2f} ({h['uniform']['entropy_bits']:.2f})", terms]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> None:
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=90)
    _pyplot().close(fig)


def format_far(runs, edges) -> list[str]:
    """Markdown rows of ``far_by_layer`` for several runs ([(name, {"far": ...} or {"error":
    why})]): a row per run and edge, a column per layer ("mean / largest head / uniform"); "—"
    where the run's context ends first; an edge no run reaches is left out."""
    edges = [e for e in edges if any(str(e) in r.get("far", {}) for _, r in runs)]
    layers = max((len(f["mean"]) for _, r in runs for f in r.get("far", {}).values()), default=0)
    lines = ["| run | beyond | " + " | ".join(f"layer {k}" for k in range(layers)) + " |",
             "|---|---|" + "---|" * layers]
    for name, r in runs:
        if "error" in r:
            lines.append(f"| {name} (not measured: {r['error']}) | |" + " |" * layers)
        for e in [] if "error" in r else edges:
            far = r["far"].get(str(e))
            cells = ["—"] * layers if far is None else [
                f"{m:.4f} / {x:.3f} / {u:.3f}" for m, x, u in zip(far["mean"], far["max"],
                                                                  far["uniform"])]
            lines.append(f"| {name} | {e:,} | " + " | ".join(cells) + " |")
    return lines


def far_text(runs, distance: int) -> str:
    """How much of its attention each run ([(name, {"far": far_by_layer(...)})]) puts beyond
    ``distance`` (an edge it was measured at): its most far-looking layer, that layer's chance
    level, its most far-looking head; "" if no run has the figure."""
    said = []
    for name, r in runs:
        if far := r.get("far", {}).get(str(distance)):
            k = max(range(len(far["mean"])), key=far["mean"].__getitem__)
            said.append(f"{name} puts at most {far['mean'][k]:.2%} of a layer's attention there "
                        f"(layer {k}, {far['uniform'][k]:.2%} by chance; its most far-looking "
                        f"head {max(far['max']):.2%})")
    return "; ".join(said)


def plot_stats(result: dict, path: str) -> None:
    """Left: layers x heads coloured by far mass; right: each layer's mass at distance >= d
    (mean over the heads reported), log-log."""
    plt = _pyplot()
    layers = result["layers"]
    far = np.array([[h["far"] for h in layer["heads"]] for layer in layers])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.3 * len(layers) + 3.2),
                                      gridspec_kw={"width_ratios": [1, 1.4]})
    fig.colorbar(left.imshow(far, aspect="auto", cmap="viridis", vmin=0), ax=left)
    left.set(xticks=range(far.shape[1]), xticklabels=[h["head"] for h in layers[0]["heads"]],
             yticks=range(len(layers)), yticklabels=[layer["layer"] for layer in layers],
             xlabel="head", ylabel="layer", title=f"mass beyond {result['far']:,} back")
    edges = result["curve_edges"]
    for layer in layers:
        curve = np.mean([h["curve"] for h in layer["heads"]], axis=0)
        tail = np.cumsum(curve[::-1])[::-1]  # mass at distance >= edges[i]
        right.plot(edges[1:-1], np.where(tail[1:] > 0, tail[1:], np.nan), marker="o",
                   markersize=2, label=f"layer {layer['layer']}")  # ends where the mass does
    right.set(xscale="log", yscale="log", xlabel="distance d (positions back)",
              ylabel="attention mass at distance >= d")
    right.grid(alpha=0.3, which="both")
    right.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{os.path.basename(result['workdir'])} step {result['step']}, "
                 f"{result['split']}, {result['windows']} windows of {result['seq_len']:,}",
                 fontsize=10)
    _save(fig, path)


def plot_figure2(rows: dict, picture, image_shape, queries, positions, heads, path) -> None:
    """The paper's Figure 2: for each query sub-pixel (a row of the grid; marked), its weights
    over the picture in each layer (the mean of its heads, or each of ``heads``), summed over a
    pixel's channels. Key j reads sub-pixel j - 1 (inputs are shifted by one), drawn there."""
    plt = _pyplot()
    r, c, ch = image_shape
    columns = [(k, h) for k in rows for h in (heads or [None])]
    fig, axes = plt.subplots(len(positions), len(columns) + 1, squeeze=False,
                             figsize=(1.6 * (len(columns) + 1), 1.7 * len(positions)))
    pixels = np.asarray(picture, np.uint8).reshape(r, c, ch)
    for i, (query, p) in enumerate(zip(queries, positions)):
        row, col = p // ch // c, p // ch % c
        panels = [("picture", pixels if ch == 3 else pixels[..., 0], "gray")]
        for k, h in columns:
            weights = rows[k][:, i].mean(0) if h is None else rows[k][h, i]
            on_pixels = np.append(weights[1:], 0.0).reshape(r, c, ch).sum(-1)
            panels.append((f"layer {k}" + ("" if h is None else f" head {h}"),
                           np.sqrt(on_pixels), "magma"))
        for ax, (title, shown, cmap) in zip(axes[i], panels):
            ax.imshow(shown, cmap=cmap, interpolation="nearest")
            ax.add_patch(plt.Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, color="cyan"))
            ax.set(xticks=[], yticks=[])
            ax.set_title(title if i == 0 else "", fontsize=8)
        axes[i][0].set_ylabel(f"{tuple(query)}", fontsize=8)
    _save(fig, path)
