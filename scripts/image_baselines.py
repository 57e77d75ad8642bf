r"""What lossless PNG and WebP cost on the pictures of a folder, in bits per dim; all logic lives
in `sparse_jax.data.baselines`.

  python scripts/image_baselines.py --path=/work/data/cifar10_jpeg             # the test split
  python scripts/image_baselines.py --path=FOLDER --split=valid --limit=1000

The folder is read and split as training reads it (sparse_jax/data/images.py: train/ and test/
subfolders, or a fixed-seed split by --split_fractions, configs/images.py's by default). Each
picture is compressed alone by PNG (optimize=True) and lossless WebP (quality=100, method=6),
and decoded again to check it is lossless; bits/dim = 8 x total bytes / total sub-pixels.
Prints a table and writes the result as JSON to --output (default:
<folder>.sparse_jax/baselines_<split>[_limit<N>].json, next to the decoded cache).
"""

from absl import app, flags

from sparse_jax import cli

_PATH = flags.DEFINE_string("path", None, "Folder of PNG or JPEG pictures (searched recursively).")
_SPLIT = flags.DEFINE_enum("split", "test", ["train", "valid", "test"], "Split to compress.")
_FRACTIONS = flags.DEFINE_list("split_fractions", ["0.92", "0.04", "0.04"], "train,valid,test "
                               "shares of a folder without train/ and test/ subfolders (valid: "
                               "the share of train/ held out when it has them).")
_LIMIT = flags.DEFINE_integer("limit", None, "Only N pictures, spread evenly over the split.")
_OUTPUT = flags.DEFINE_string("output", None, "Where the JSON goes.")
flags.mark_flags_as_required(["path"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        fractions = tuple(float(x) for x in _FRACTIONS.value)
    except ValueError:
        raise app.UsageError(f"--split_fractions: numbers, got {_FRACTIONS.value}") from None
    from sparse_jax import logs
    from sparse_jax.data import baselines

    bars = []

    def progress(done, total):
        if not bars:
            bars.append(logs.Progress(total, f"compressing {_SPLIT.value}", unit="picture"))
        bars[0].update(done, done, "pictures")

    result = baselines.baselines(_PATH.value, _SPLIT.value, fractions, _LIMIT.value,
                                 progress=progress)
    output = _OUTPUT.value or baselines.default_output(_PATH.value, _SPLIT.value, _LIMIT.value)
    baselines.save(result, output)
    print(baselines.format_table(result))
    print(f"Wrote {output} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    cli.run(main)
