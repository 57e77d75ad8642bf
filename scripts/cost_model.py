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
Either already there (or a folder) is refused before the fit unless --overwrite is given.
"""

import json
import os

from absl import app, flags

from sparse_jax import cli
from sparse_jax.bench import cost_model

_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Where the results go as JSON (and the "
                                   "table as results.md beside it); default: print only.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --output_json and the "
                               "results.md beside it.")
_STARTS = flags.DEFINE_integer("starts", 24, "Starting points of the least-squares fit (at "
                               "most 1,000).", lower_bound=1, upper_bound=1000)


def check(argv):
    """Every flag, before the fit starts."""
    cli.no_arguments(argv)
    cli.output_file("output_json", _OUTPUT_JSON.value, _OVERWRITE.value, beside=('results.md',))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    result = cost_model.calibrate(starts=_STARTS.value)
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
    if _OUTPUT_JSON.value:
        folder = os.path.dirname(os.path.abspath(_OUTPUT_JSON.value))
        os.makedirs(folder, exist_ok=True)
        with open(_OUTPUT_JSON.value, "w") as f:
            json.dump({"command": "python scripts/cost_model.py "
                       f"--output_json={_OUTPUT_JSON.value}", "measured": cost_model.MEASURED,
                       "static": cost_model.STATIC, "held_out": cost_model.HELD_OUT,
                       **result, "static_baseline": baseline, "designs": designs,
                       "shares": shares}, f, indent=1)
        with open(os.path.join(folder, "results.md"), "w") as f:
            f.write("# The cost model's fit\n\n`python scripts/cost_model.py "
                    f"--output_json={_OUTPUT_JSON.value}` (docs/cost_model.md).\n\n" + text)
        print(f"Wrote {_OUTPUT_JSON.value} and {folder}/results.md")


if __name__ == "__main__":
    cli.run(main, check=check)
