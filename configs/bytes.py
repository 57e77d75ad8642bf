r"""Any byte file (bits per byte): the enwik8 models and variants on your own data.

Command:
  python scripts/train.py --config=configs/bytes.py:size=small --workdir=workdirs/mydata \
      --config.data.path=/path/to/file
Variants (as in enwik8.py): pattern = fixed (default) | strided | dense; size = paper | small
| tiny. The file is split into contiguous train / valid / test parts by
--config.data.split_fractions (default 0.9 / 0.05 / 0.05); each needs more than seq_len + 1
bytes for training windows (train) and at least one byte (valid).

Hardware, wall time: as enwik8.py for a 100 MB file (size=paper: GPUs; size=tiny: seconds on a
2-core CPU). Target metric: validation bits per byte, which depends on the file; for reference,
a unigram model scores the file's byte entropy and gzip -9 about 8 x its compression ratio.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import enwik8  # noqa: E402  (configs/enwik8.py: the same sizes and patterns)


def get_config(arg=None):
    c = enwik8.get_config(arg)
    c.data.name = "bytes"  # any file, read as a memory map
    c.data.path = None  # required: --config.data.path=FILE
    return c
