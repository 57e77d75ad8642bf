r"""Builds the larger code corpus, data/code_corpus.py.gz, from pinned PyPI source distributions.

  nice -n 19 python scripts/build_code_corpus.py --overwrite  # downloads 131 MB of sdists once
  python scripts/train.py --config=configs/code.py:size=long --workdir=workdirs/code_big \
      --config.data.path=data/code_corpus.py.gz

The 30 sdists of data/code_corpus_pins.txt (name==version, file name, sha256) are downloaded
from PyPI into --sdists (or put there by hand, offline) and checked; their `.py` files, tests
left out, become one file in the layout of data/cpython_lib.py.gz, written with
code_corpus.files.txt, code_corpus.licenses.txt and code_corpus.sha256 beside it. Only
permissively licensed packages are accepted. About 30 s on 2 cores, downloads included (up to
1.5 min on a busy host); the figures of the build are in data/README.md. Logic:
`sparse_jax.data.code_corpus`.

--output is checked before anything is downloaded, read or written: a folder in the place of
the corpus or of one of its records, or no folder this user can write in above it, is one
`error:` line (folders missing below a writable one are made). The corpus and its records are
each written in full under a temporary name, then renamed into place, the corpus first: any
failure (a full disk at the last byte included) leaves every one of them as it was, and no
temporary file.
"""

import os
import time

from absl import app, flags

from sparse_jax import cli
from sparse_jax.data import code_corpus

_PINS = flags.DEFINE_string("pins", code_corpus.PINS, "The pinned sdists: one "
                            "'name==version  filename  sha256' a line.")
_SDISTS = flags.DEFINE_string("sdists", code_corpus.SDISTS, "Folder of the sdists: read from "
                              "it, missing ones downloaded into it.")
_OUTPUT = flags.DEFINE_string("output", code_corpus.OUTPUT, "The corpus to write (.py.gz); its "
                              ".files.txt, .licenses.txt and .sha256 go beside it.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --output and the "
                               "records beside it.")
_DOWNLOAD = flags.DEFINE_bool("download", True, "Download missing sdists from PyPI "
                              "(--nodownload: only read --sdists).")


def check(argv):
    """Every flag, before anything is downloaded, read or written: the pins parse, --sdists is
    a folder (or is made), --output can be written."""
    cli.no_arguments(argv)
    cli.input_file("pins", _PINS.value, "the file of pinned sdists")
    try:
        code_corpus.read_pins(_PINS.value)
    except (ValueError, UnicodeDecodeError) as e:
        raise app.UsageError(f"--pins={_PINS.value}: {e}") from None
    if not _SDISTS.value or os.path.lexists(_SDISTS.value) and not os.path.isdir(_SDISTS.value):
        raise app.UsageError(f"--sdists={_SDISTS.value} is not a folder; give the folder of the "
                             "sdists (missing ones are downloaded into it)")
    cli.output_file("output", _OUTPUT.value, _OVERWRITE.value, beside=tuple(
        os.path.basename(r) for r in code_corpus.records(_OUTPUT.value or "corpus.py.gz")))
    if not _OUTPUT.value.endswith(".gz"):
        raise app.UsageError(f"--output={_OUTPUT.value} must end in .gz (the corpus is written "
                             "gzip -9'd)")
    try:
        code_corpus.check_output(_OUTPUT.value)
    except ValueError as e:
        raise app.UsageError(f"--output: {e}") from None


def main(argv):
    start = time.perf_counter()
    built = code_corpus.build(_PINS.value, _SDISTS.value, _OUTPUT.value, _DOWNLOAD.value)
    print("| package | licence (from PKG-INFO) | files | bytes |\n|---|---|---|---|")
    for p in built["packages"]:
        print(f"| {p['package']} | {p['licence']} ({p['licence_source']}) | {p['files']:,} | "
              f"{p['bytes']:,} |" + (f" skipped (not UTF-8): {p['skipped']}" if p["skipped"]
                                     else ""))
    print(f"\nWrote {built['output']}: {built['files']:,} files, {built['bytes']:,} bytes, "
          f"{built['gz_bytes']:,} gzipped, in {time.perf_counter() - start:.0f} s; beside it "
          f"{', '.join(built['beside'])}, which holds these lines:\n"
          f"{built['gz_sha256']}  {built['output'].rsplit('/', 1)[-1]}\n"
          f"{built['sha256']}  {built['output'].rsplit('/', 1)[-1][:-3]}")


if __name__ == "__main__":
    cli.run(main, check=check)
