r"""Calibrates the cost model of the Pallas attention kernels (sparse_jax/bench/cost_model.py) on
the committed measurements (docs/benchmarks/h200_2026-11-28, h200, h100) and the committed
static figures of the deviceless compile (docs/benchmarks/compiled_h100), with no GPU: prints
each measured row (measured, predicted, ratio, held out of the fit), the Spearman correlation
of predicted with measured times per report, pattern and length, the compile report's own
estimate beside it, where the time of four programs goes, and the model's time for kernel
designs not yet built.

  python scripts/cost_model.py
  python scripts/cost_model.py --output_json=docs/benchmarks/cost_model/results.json --overwrite

--output_json also writes the markdown table beside it (results.md). docs/cost_model.md reads it.

After a loan, its report joins the fit in one step (its Pallas attention rows need static
figures: a compile report in STATIC, or given with --static):

  python scripts/cost_model.py --measured=h100_2026-12-01=reports/h100 \
      --output_json=docs/benchmarks/cost_model/results.json --overwrite

Predictions on record (sparse_jax/bench/predictions.py): the fitted model's time for every
Pallas attention row of the accelerator report's plan, and the paper's 16k steps, written before
a loan; the report prints them beside its measurements. A new kernel's, from its compiled rows:

  python scripts/cost_model.py --predictions=docs/benchmarks/cost_model/predictions.json --overwrite
  python scripts/cost_model.py --static=docs/benchmarks/compiled_h100/new/results.json \
      --patterns=strided:128@pallas:NEW --lengths=8192,16384,32768,65536 \
      --predictions=docs/benchmarks/cost_model/predictions_new.json

--output_json, the results.md beside it and --predictions, already there (or a folder), are
refused before the fit unless --overwrite is given.
"""

import json
import os

from absl import app, flags

from sparse_jax import cli
from sparse_jax.bench import cost_model, predictions

_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Where the results go as JSON (and the "
                                   "table as results.md beside it); default: print only.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --output_json, the "
                               "results.md beside it, or --predictions.")
_STARTS = flags.DEFINE_integer("starts", 24, "Starting points of the least-squares fit (at "
                               "most 1,000).", lower_bound=1, upper_bound=1000)
_MEASURED = flags.DEFINE_list("measured", None, "More accelerator reports for the fit, as "
                              "LABEL=PATH (a report folder or its results.json), beside "
                              "cost_model.MEASURED.")
_STATIC = flags.DEFINE_list("static", None, "More compile reports' results.json (scripts/"
                            "compile_report.py; compiled today: a row naming no variant runs "
                            "the measured default) beside cost_model.STATIC.")
_PREDICTIONS = flags.DEFINE_string("predictions", None, "Write the predictions table (JSON) "
                                   "here: the fitted model's time for each Pallas row.")
_PATTERNS = flags.DEFINE_list("patterns", None, "Pallas attention rows to predict (default: "
                              "every Pallas row of the accelerator report's plan).")
_LENGTHS = flags.DEFINE_list("lengths", None, "Lengths of --patterns (default 8192,16384,"
                             "32768,65536).")


def _measured() -> tuple:
    return cost_model.MEASURED + tuple(predictions.report_source(item, "--measured")
                                       for item in _MEASURED.value or ())


def _static() -> tuple:
    for path in _STATIC.value or ():
        cli.input_file("static", path, "a compile report's results.json")
    return cost_model.STATIC + tuple(os.path.abspath(p) for p in _STATIC.value or ())


def _rows() -> list[tuple[str, int]]:
    """The (pattern, n) pairs to predict."""
    if _PATTERNS.value is None:
        if _LENGTHS.value is not None:
            raise ValueError("--lengths applies to --patterns; give both")
        from sparse_jax.bench.accelerator import attention

        return [(p, g["seq_len"]) for g in attention.plan(False)["groups"]
                for p in g["patterns"]]
    from sparse_jax.bench.attention import parse_pattern

    lengths = cli.integers("lengths", _LENGTHS.value or ["8192", "16384", "32768", "65536"])
    for pattern in _PATTERNS.value:
        try:
            parse_pattern(pattern, lengths[0], backend="triton")
        except ValueError as e:
            raise ValueError(f"--patterns: {e}") from None
        if "@pallas" not in pattern:
            raise ValueError(f"--patterns: {pattern} is not a Pallas kernel (PATTERN@pallas...)")
    return [(p, n) for p in _PATTERNS.value for n in lengths]


def check(argv):
    """Every flag, before the fit starts."""
    cli.no_arguments(argv)
    cli.output_file("output_json", _OUTPUT_JSON.value, _OVERWRITE.value, beside=("results.md",))
    cli.output_file("predictions", _PREDICTIONS.value, _OVERWRITE.value)
    _measured()
    _static()
    _rows()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    result = cost_model.calibrate(starts=_STARTS.value, measured=_measured(),
                                  static_paths=_static())
    baseline = cost_model.static_baseline(result)
    designs = cost_model.what_if(result["params"])
    shares = {f"{pattern} {n}": cost_model.breakdown(result["params"], pattern, n)
              for pattern, n in cost_model.WHAT_IF_BASES}
    text = cost_model.markdown(result, baseline, designs)
    text += "\nWhere the predicted time goes (H200):\n\n| program | ms | launches | per program " \
            "| per tile | products | XLA bytes |\n|---|---|---|---|---|---|---|\n"
    for name, s in shares.items():
        text += (f"| {name} | {s['ms']:.3g} | " + " | ".join(
            f"{s[k]:.0%}" for k in ("launch", "programs", "tiles", "products", "xla_bytes"))
            + " |\n")
    print(text)
    if _PREDICTIONS.value:
        _write_predictions(result["params"])
    if _OUTPUT_JSON.value:
        folder = os.path.dirname(os.path.abspath(_OUTPUT_JSON.value))
        os.makedirs(folder, exist_ok=True)
        with open(_OUTPUT_JSON.value, "w") as f:
            json.dump({"command": "python scripts/cost_model.py "
                       f"--output_json={_OUTPUT_JSON.value}", "measured": _measured(),
                       "static": _static(), "held_out": cost_model.HELD_OUT,
                       **result, "static_baseline": baseline, "designs": designs,
                       "shares": shares}, f, indent=1)
        with open(os.path.join(folder, "results.md"), "w") as f:
            f.write("# The cost model's fit\n\n`python scripts/cost_model.py "
                    f"--output_json={_OUTPUT_JSON.value}` (docs/cost_model.md).\n\n" + text)
        print(f"Wrote {_OUTPUT_JSON.value} and {folder}/results.md")


def _write_predictions(params: dict) -> None:
    """The predictions table for the rows asked (``predictions.table``), printed and written."""
    import sys
    import time

    extra = tuple((os.path.abspath(p), "measured") for p in _STATIC.value or ())
    cases = None
    if _PATTERNS.value is None:  # the report's plan: its own training steps
        from sparse_jax.bench.accelerator import train_step

        cases = {c["name"] for c in train_step.plan(False)["cases"]}
    table = predictions.table(params, _rows(), static_paths=predictions.STATIC + extra,
                              cases=cases)
    table = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(
        ["python", "scripts/cost_model.py", *sys.argv[1:]]), **table}
    print("Predictions (ms; attention: forward + backward, B=1 H=8 d=64; train_step: a step):\n"
          "\n| stage | row | n | device | predicted ms |\n|---|---|---|---|---|")
    for r in table["rows"]:
        print(f"| {r['stage']} | {r['row']} | {r.get('n') or '—'} | {r['device']} | "
              f"{r['ms']:.4g} |")
    if table["no_static_figures"]:
        print("\nNot predicted (no static figures; compile them with scripts/compile_report.py "
              "and pass --static): " + ", ".join(table["no_static_figures"]))
    folder = os.path.dirname(os.path.abspath(_PREDICTIONS.value))
    os.makedirs(folder, exist_ok=True)
    with open(_PREDICTIONS.value, "w") as f:
        json.dump(table, f, indent=1)
    print(f"Wrote {_PREDICTIONS.value}")


if __name__ == "__main__":
    cli.run(main, check=check)
