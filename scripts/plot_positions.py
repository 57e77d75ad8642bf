r"""Draws the bits-by-position curves of several evaluation results on one figure.

  python scripts/plot_positions.py --output=positions.png \
      workdirs/kjv_cpu/eval/valid_2900.json workdirs/kjv_long/eval/valid_1000.json \
      [--label="context 512, 1.689" --label="context 4096, 1.689"] [--title=...]

Each JSON is what scripts/evaluate.py writes (DIR/eval/<split>_<step>.json); its
"position_curve" (bits in buckets of 4 per doubling of the position) is drawn against the
position in the window, log scale. The logic is `sparse_jax.evaluate.plot_by_position`.
"""

import json

from absl import app, flags

from sparse_jax import cli

_OUTPUT = flags.DEFINE_string("output", None, "Where the PNG goes.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --output.")
_LABELS = flags.DEFINE_multi_string("label", None, "A legend label, once per result in order "
                                    "(default: the run folder, step and bits).")
_TITLE = flags.DEFINE_string("title", "", "Title of the figure.")
flags.mark_flags_as_required(["output"])


def _results(argv) -> list[dict]:
    """The evaluation results the arguments name, each checked (one `error:` line if not)."""
    paths = argv[1:]
    if not paths:
        raise app.UsageError("give one or more evaluation JSON files (DIR/eval/*.json)")
    if _LABELS.value and len(_LABELS.value) != len(paths):
        raise app.UsageError(f"{len(_LABELS.value)} --label flags for {len(paths)} files")
    cli.output_file("output", _OUTPUT.value, _OVERWRITE.value)
    results = []
    for path in paths:
        try:
            with open(path) as f:
                result = json.load(f)
        except (OSError, ValueError) as e:
            cli.fail(f"cannot read {path} as an evaluation result ({e}); give files that "
                     "scripts/evaluate.py wrote (DIR/eval/*.json)")
        if "position_curve" not in result:
            cli.fail(f"{path} has no bits by position (written by an older evaluate.py); "
                     "evaluate the checkpoint again with --overwrite")
        results.append(result)
    return results


def main(argv):
    results = _results(argv)
    from sparse_jax import evaluate

    evaluate.plot_by_position(results, _OUTPUT.value, _LABELS.value, _TITLE.value)
    print(f"Wrote {_OUTPUT.value}")


if __name__ == "__main__":
    cli.run(main, check=_results)
