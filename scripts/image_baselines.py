r"""What lossless PNG and WebP cost on the pictures of a folder, in bits per dim; all logic lives
in `sparse_jax.data.baselines`.

  python scripts/image_baselines.py --path=/work/data/cifar10_jpeg             # the test split
  python scripts/image_baselines.py --path=FOLDER --split=valid --limit=1000

The folder is read and split as training reads it (sparse_jax/data/images.py: train/ and test/
subfolders, or a fixed-seed split by --split_fractions, configs/images.py's by default). Each
picture is compressed alone by PNG (optimize=True) and lossless WebP (quality=100, method=6),
and decoded again to check it is lossless; bits/dim = 8 x total bytes / total sub-pixels.
Prints a table and writes the result as JSON to --output (default:
<folder>.sparse_jax/baselines_<split>[_limit<N>].json, next to the decoded cache); a result
already there is replaced only with --overwrite.
"""

from absl import app, flags

from sparse_jax import cli

_PATH = flags.DEFINE_string("path", None, "Folder of PNG or JPEG pictures (searched recursively).")
_SPLIT = flags.DEFINE_enum("split", "test", ["train", "valid", "test"], "Split to compress.")
_FRACTIONS = flags.DEFINE_list("split_fractions", ["0.92", "0.04", "0.04"], "train,valid,test "
                               "shares of a folder without train/ and test/ subfolders (valid: "
                               "the share of train/ held out when it has them).")
cli.list_rules(_FRACTIONS, repeats="two splits may have the same share")
_LIMIT = flags.DEFINE_integer("limit", None, "Only N pictures, spread evenly over the split.",
                              lower_bound=1)
_OUTPUT = flags.DEFINE_string("output", None, "Where the JSON goes.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --output.")
flags.mark_flags_as_required(["path"])


def _fractions() -> tuple[float, float, float]:
    fractions = tuple(cli.numbers("split_fractions", _FRACTIONS.value, low=0, high=1))
    if len(fractions) != 3 or abs(sum(fractions) - 1) > 1e-6:
        raise app.UsageError(f"--split_fractions={','.join(_FRACTIONS.value)}: give 3 shares "
                             "(train, valid, test) that sum to 1")
    return fractions


def check(argv):
    """Every flag and the pictures' headers, before any picture is decoded or anything is
    written."""
    cli.no_arguments(argv)
    _fractions()
    cli.input_dir("path", _PATH.value, "a folder of PNG or JPEG pictures")
    from sparse_jax.data import baselines, images

    default = baselines.default_output(_PATH.value, _SPLIT.value, _LIMIT.value)
    cli.output_file("output", default if _OUTPUT.value is None else _OUTPUT.value,
                    _OVERWRITE.value)  # the default too: the result of an earlier run

    try:
        images.folder_shape(_PATH.value)  # pictures there, of one size: from their headers
    except (ValueError, OSError) as e:
        raise app.UsageError(f"--path={_PATH.value}: {e}") from None


def main(argv):
    fractions = _fractions()
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
    cli.run(main, check=check)
