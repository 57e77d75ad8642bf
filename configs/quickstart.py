r"""Quickstart: a small strided Sparse Transformer on the embedded dataset (no download).

Command:
  python scripts/train.py --config=configs/quickstart.py --workdir=workdirs/quickstart
Hardware: a 2-core CPU. Wall time: measured 113 s in total (start-up and compilation included)
on an idle 2-core AMD EPYC; about 4 min while other jobs loaded the same two cores.
Target: validation bits/byte <= 2.04, half the data's unigram entropy (4.08 bits); measured
1.58 after 500 steps (1.69 at step 250). The best possible is 0.76, or ~1.30 with this context
(the first 127 positions of a window cannot see the row their target copies).

The embedded data (sparse_jax.data.embedded_bytes) are rows of 32 bytes, three quarters of them
exact copies of the row 4 rows (128 bytes) back. Its entropy rate is 0.76 bits/byte for a model
that sees the copies and 2.94 for one that cannot look 128 bytes back, so getting below 2.04
needs the long-range part of the pattern. Position i predicts byte i + 1, whose copy sits 128
bytes before it, i.e. 127 positions before i: with stride 127 the strided part of every query
reaches it directly (the same column of the grid, one row up), and the model only has to learn
to copy what it sees there. With stride 32 or 128 (the row width, the copy distance) the copy
needs an attention head that finds a relative offset of 31 or 127 from absolute position
embeddings; measured here, 2-layer models with those strides (and dense attention) stayed at
~3.15 bits/byte (bigram level) for 400-1,500 steps, while stride 127 passed 2.04 in ~150 steps.
The local window (33) covers the current row and the newline before it.
  pattern = strided (default) | local (window 33 only: cannot see the copies, so it cannot get
            below 2.94) | dense | fixed (l=127, c=32: the paper's c = l/4; a query sees its own
            row of the grid and the last 32 positions of every earlier row, so only a quarter of
            the copy sources directly)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (configs/common.py: the shared fields)


def get_config(arg=None):
    args = common.parse_args(arg, pattern=("strided", "local", "dense", "fixed"))
    c = common.base()
    c.data.name = "embedded"  # generated in-process (data.embedded_bytes)
    c.data.embedded_bytes = 2**21  # 2 MiB: 1.9M train / 105K valid / 105K test bytes

    c.model.seq_len = 508  # context: 4 rows of the 127-wide grid (~16 rows of data)
    c.model.num_layers = 2  # residual blocks
    c.model.d_model = 128  # width
    c.model.num_heads = 4  # heads
    c.model.pattern = args["pattern"]  # strided: local window + every 127th byte back
    c.model.stride = 127  # l: the copy source of each target is 127 positions back
    if args["pattern"] == "fixed":
        c.model.c = 32  # summary width, l / 4 (paper: l=128, c=32)
    # Local window of 33: the current row and the previous newline (dense and fixed have none).
    c.model.local_width = 33 if args["pattern"] in ("strided", "local") else None
    c.model.pos_emb = "text"  # row and column of the (4, 127) grid
    c.model.mode = "merged"  # every head attends both parts

    c.batch_size = 8  # windows per step (4,064 bytes)
    c.total_steps = 500  # optimizer steps
    c.optimizer.lr = 3e-3  # peak learning rate (small model, short run)
    c.optimizer.warmup_steps = 50  # linear warmup
    c.optimizer.min_lr_ratio = 0.1  # the cosine ends at 3e-4
    c.log_every = 50  # steps between train-loss lines
    c.eval_every = 250  # steps between validation passes
    c.eval_batches = -1  # the whole valid split (105K bytes, 26 batches)
    c.checkpoint_every = 250  # steps between checkpoints
    return common.finish(c)
