r"""How much of a byte split exact copying could predict at each context length: the share of
bytes whose preceding k bytes occurred within D bytes before, and of those, the bytes that
equal what followed that occurrence (`sparse_jax.data.baselines.repeat_reach`). A model that copies
from its context can gain on those bytes, and only from a context that reaches them.

  python scripts/repeats.py --config=configs/bytes.py:size=cpu_long --split=valid \
      --distances=64,512,4096,0
  python scripts/repeats.py --config=configs/code.py --config.data.path=FILE --split=test \
      --compressors

The split is read as training cuts it (`sparse_jax.data.datasets`), but nothing is trained: any file
whose split holds a byte is measured. Distance 0: anywhere earlier in it.
--compressors adds what gzip -9, bzip2 -9 and xz -9e pay for the split given every split before
it (`baselines.compressor_bits`; 1.5 minutes for 12 MB on 2 cores), the figures to hold a
model's bits on that split against.
"""

import json

from absl import app, flags
from ml_collections import config_flags

from sparse_jax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file; uses config.data.",
                                          lock_config=True)
_SPLIT = flags.DEFINE_enum("split", "valid", ["train", "valid", "test"], "Split to measure.")
_DISTANCES = flags.DEFINE_list("distances", ["64", "512", "4096", "0"],
                               "Bytes back a copier may look (0: unlimited).")
_K = flags.DEFINE_integer("k", 12, "Bytes that must repeat before a copy is predicted (at "
                          "most 1,024: each position holds its k bytes while they are sorted).",
                          lower_bound=1, upper_bound=1024)
_COMPRESSORS = flags.DEFINE_bool("compressors", False, "Also measure what gzip -9, bzip2 -9 "
                                 "and xz -9e pay for the split given the splits before it.")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the result here as JSON.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --output.")
flags.mark_flags_as_required(["config"])


def check(argv):
    """Every flag and the config's data, before the data is read."""
    cli.no_arguments(argv)
    cli.integers("distances", _DISTANCES.value, low=0)
    cli.output_file("output", _OUTPUT.value, _OVERWRITE.value)
    from sparse_jax.data import datasets as data_lib
    from sparse_jax.data import sources

    data = data_lib.data_config(_CONFIG.value.data)
    if data.is_image:
        raise app.UsageError(f"{data.name} holds pictures; repeats measures byte streams")
    if data.name == "bytes":
        sources.require_file(data.path)


def main(argv):
    distances = cli.integers("distances", _DISTANCES.value, low=0)
    from sparse_jax.data import baselines
    from sparse_jax.data import datasets as data_lib

    config = _CONFIG.value
    dataset = data_lib.make_dataset(config.data, config.model.seq_len, training=False)
    dataset.require(_SPLIT.value, 1, "measuring it", ", or measure another --split")
    split = dataset.splits[_SPLIT.value]
    reach = baselines.repeat_reach(split, distances, _K.value)
    print(f"{_SPLIT.value} split of {dataset.source}: {len(split):,} bytes; a repeat = the "
          f"{_K.value} bytes before a position occurred before\n")
    print("| within | repeats seen | next byte copied |\n|---|---|---|")
    for d, row in reach.items():
        print(f"| {f'{d:,} bytes' if d else 'anywhere'} | {row['seen']:.2%} | "
              f"{row['copied']:.2%} |")
    result = {"split": _SPLIT.value, "bytes": len(split), "k": _K.value,
              "reach": {str(d): row for d, row in reach.items()}}
    if _COMPRESSORS.value:
        from sparse_jax.data.sources import SPLITS

        before = [dataset.splits[s] for s in SPLITS[:SPLITS.index(_SPLIT.value)]]
        bits = baselines.compressor_bits(b"".join(bytes(x) for x in before), split)
        print(f"\nCompressors on the {_SPLIT.value} split, given the {sum(map(len, before)):,} "
              "bytes before it (bits/byte)\n\n| compressor | bits/byte |\n|---|---|")
        for name, b in bits.items():
            print(f"| {name} | {b:.3f} |")
        result["compressors"] = bits
    if _OUTPUT.value:
        from sparse_jax.files import atomic_write

        with atomic_write(_OUTPUT.value) as f:
            json.dump(result, f, indent=1)
        print(f"Wrote {_OUTPUT.value}")


if __name__ == "__main__":
    cli.run(main, check=check)
