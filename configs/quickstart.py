r"""Quickstart: a small strided Sparse Transformer learning real text on a 2-core CPU.

Command (no download: the corpus ships with the repository):
  python scripts/train.py --config=configs/quickstart.py --workdir=workdirs/quickstart
Data: data/kjv.html.gz, the King James Bible as HTML (4.78 MB, public domain; data/README.md),
split 90% / 5% / 5% into train / valid / test. On the valid part, conditional on the text
before it, gzip -9 costs 2.59 bits/byte, xz -9e 1.93 and bzip2 -9 1.86.
Hardware: a 2-core CPU. Wall time: about two minutes from process start (compilation, two
validation passes and checkpoints included): 1 min 50 s on the host of docs/results.md, which
has the measured result and wall time; the README quotes the same. Target: validation
bits/byte <= 2.00.

Variants are config arguments:
  pattern = strided (default) | dense | fixed | local   (the same model and budget otherwise)
  data    = kjv (default) | embedded: the generated stream of data.sources.embedded_bytes,
            rows of 32 bytes, 75% of them copies of the row 128 bytes back, with the model
            built for it (stride 127, so the strided part sees each copy source; 2 layers,
            context 508). Bits/byte floor 0.76 for a model that sees the copies, 2.94 for
            one that does not (results: docs/pattern_study.md).
"""

from configs import common


def get_config(arg=None):
    args = common.parse_args(arg, pattern=("strided", "dense", "fixed", "local"),
                             data=("kjv", "embedded"))
    if args["data"] == "embedded":
        return _embedded(args["pattern"])
    c = common.base()
    c.data.name = "bytes"  # a byte file, read as a memory map
    c.data.path = "data/kjv.html.gz"  # shipped corpus (decompressed once next to it, checked)

    c.model.seq_len = 256  # context
    c.model.num_layers = 4  # residual blocks
    c.model.d_model = 128  # width
    c.model.num_heads = 4  # heads
    c.model.pattern = args["pattern"]  # strided: local window + every 16th byte back
    c.model.stride = 16  # l = sqrt(context)
    c.model.c = 4  # summary width of the fixed variant, l / 4 (paper)
    c.model.pos_emb = "text"  # row and column of the (16, 16) grid
    c.model.mode = "merged"  # every head attends both parts
    c.model.attention = "auto"  # on a CPU the fused CPU kernels where they build (else xla)

    c.batch_size = 8  # windows per step (2,048 bytes)
    c.total_steps = 1600  # optimizer steps
    c.optimizer.lr = 6e-3  # peak learning rate (small model, short run)
    c.optimizer.warmup_steps = 100  # linear warmup
    c.optimizer.min_lr_ratio = 0.1  # the cosine ends at 6e-4
    c.log_every = 100  # steps between train-loss lines
    c.eval_every = 800  # steps between validation passes
    c.eval_batches = -1  # the whole valid split (239K bytes, 117 batches)
    c.checkpoint_every = 800  # steps between checkpoints
    return common.finish(c)


def _embedded(pattern: str):
    c = common.base()
    c.data.name = "embedded"  # generated in-process (data.embedded_bytes)
    c.data.embedded_bytes = 2**21  # 2 MiB: 1.9M train / 105K valid / 105K test bytes

    c.model.seq_len = 508  # context: 4 rows of the 127-wide grid (~16 rows of data)
    c.model.num_layers = 2  # residual blocks
    c.model.d_model = 128  # width
    c.model.num_heads = 4  # heads
    c.model.pattern = pattern  # strided: local window + every 127th byte back
    c.model.stride = 127  # l: the copy source of each target is 127 positions back
    if pattern == "fixed":
        c.model.c = 32  # summary width, l / 4 (paper: l=128, c=32)
    # Local window of 33: the current row and the previous newline (dense and fixed have none).
    c.model.local_width = 33 if pattern in ("strided", "local") else None
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
