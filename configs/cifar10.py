r"""CIFAR-10 (bits per dim), paper §7 / docs/design.md §5: 128 layers, d=256, 2 heads, half-size
feed-forward and query/key, strided pattern with stride 96 (one image row of 32 x 3 sub-pixels,
openai's code), context 3,072, dropout 0.25; 59M parameters.

Command (the TFDS `cifar10` builder is prepared on first use from cifar-10-binary.tar.gz in
--config.data.manual_dir, default <data_dir>/downloads/manual):
  python scripts/train.py --config=configs/cifar10.py --workdir=workdirs/cifar10
Variants are config arguments, e.g.
  python scripts/train.py --config=configs/cifar10.py:pattern=fixed,size=small --workdir=...
  pattern = strided (default, paper) | fixed (l=96, c=24) | dense   (paper Table 2)
  size    = paper (default) | small | mini | tiny

size=paper: 16 images per step for 360,000 steps = 120 epochs of the 48,000 training images
  (paper); layers cycle local, local, local, strided as in openai's CIFAR-10 code.
  Hardware: GPUs (bfloat16 compute, full remat), e.g. 8 x H100. Wall time: not measured yet; the
  run is ~6.6e18 training FLOPs (~8.8e18 with remat), about 3 h on 8 GPUs that sustain 100
  TFLOP/s each. Target: 2.80 bits/dim on test (paper; Table 2: strided 2.80, fixed 2.85, dense
  2.82).
size=small: 16 layers, 30,000 steps of 16 images (10 epochs). One GPU; wall time and bits/dim
  not measured yet.
size=mini: 2 layers, d=64, 400 steps of 4 images: a pattern comparison on a 2-core CPU, e.g.
  on the synthetic images of tests/fake_cifar10.py (see docs/pattern_study.md):
    python scripts/compare_patterns.py --config=configs/cifar10.py:size=mini \
        --config.data.data_dir=workdirs/shapes_cifar10/tfds --workdir=workdirs/shapes_study
  Wall time: about 20 minutes for the three patterns on a 2-core CPU, most of it dense;
  per-pattern times and validation bits/dim are in docs/pattern_study/shapes/results.md.
size=tiny: 2 layers, d=32, 4 steps of 2 images: a smoke test that runs in seconds on a 2-core
  CPU (the loss barely moves).
"""

from configs import common


def get_config(arg=None):
    args = common.parse_args(arg, pattern=("strided", "fixed", "dense"),
                             size=("paper", "small", "mini", "tiny"))
    c = common.base()
    c.data.name = "cifar10"  # TFDS cifar10: 48,000 train / 2,000 valid / 10,000 test

    c.model.seq_len = 3072  # 32 x 32 x 3 sub-pixels in raster order
    c.model.pos_emb = "image"  # row, column and channel tables
    c.model.image_shape = (32, 32, 3)  # rows, columns, channels
    c.model.pattern = args["pattern"]  # strided (paper) | fixed | dense
    c.model.stride = 96  # l: one image row (openai's code)
    c.model.c = 24  # summary width of the fixed variant, l / 4
    # openai's CIFAR-10 code: three local layers, then one strided layer; merged heads otherwise.
    c.model.schedule = "local,local,local,strided" if args["pattern"] == "strided" else ""
    c.model.ff_mult = 2.0  # half-size feed-forward (paper)
    c.model.qk_ratio = 0.5  # half-size query/key projections (paper)
    if args["size"] == "paper":
        c.model.num_layers = 128  # paper
        c.model.d_model = 256  # paper
        c.model.num_heads = 2  # paper
        c.model.dropout = 0.25  # paper
        c.model.remat = "full"  # recompute blocks in the backward pass (paper)
        c.model.scan_layers = True  # compile one period of 4 layers instead of 128 layers
        c.model.dtype = "bfloat16"  # mixed precision, float32 master weights
        c.model.attention = "auto"  # the Pallas kernel on a GPU or TPU (docs/benchmarks/h200)
        c.batch_size = 16  # not given in the paper: 2 per GPU on its 8-GPU node
        c.total_steps = 360000  # 120 epochs (paper) of 48,000 images / 16
        c.optimizer.lr = 3.5e-4  # paper
        c.optimizer.warmup_steps = 5000  # paper (openai's code: 15,000)
        c.log_every = 100  # steps between train-loss lines
        c.eval_every = 5000  # steps between validation passes
        c.eval_batches = -1  # all 2,000 valid images
        c.checkpoint_every = 5000  # steps between checkpoints
    elif args["size"] == "small":
        c.model.num_layers = 16  # residual blocks
        c.model.d_model = 256  # width
        c.model.num_heads = 2  # heads
        c.model.dropout = 0.1  # less than the paper's 0.25 for a shorter run
        c.model.dtype = "bfloat16"  # mixed precision, float32 master weights
        c.model.attention = "auto"  # the Pallas kernel on a GPU or TPU (docs/benchmarks/h200)
        c.batch_size = 16  # images per step
        c.total_steps = 30000  # 10 epochs
        c.optimizer.lr = 5e-4  # peak learning rate
        c.optimizer.warmup_steps = 1000  # linear warmup
        c.log_every = 100  # steps between train-loss lines
        c.eval_every = 2000  # steps between validation passes
        c.eval_batches = -1  # all 2,000 valid images
        c.checkpoint_every = 2000  # steps between checkpoints
    elif args["size"] == "mini":  # a pattern comparison on a 2-core CPU
        c.model.num_layers = 2  # residual blocks
        c.model.d_model = 64  # width
        c.model.num_heads = 2  # heads (paper)
        if args["pattern"] == "strided":
            c.model.schedule = "local,strided"  # both parts in two layers
        c.batch_size = 4  # images per step
        c.total_steps = 400  # optimizer steps
        c.optimizer.lr = 3e-3  # peak learning rate (small model, short run)
        c.optimizer.warmup_steps = 20  # linear warmup
        c.optimizer.min_lr_ratio = 0.1  # the cosine ends at 3e-4
        c.log_every = 10  # steps between train-loss lines
        c.eval_every = 50  # steps between validation passes
        c.eval_batches = 10  # 40 valid images per pass during training
        c.checkpoint_every = 200  # steps between checkpoints
    else:  # tiny
        c.model.num_layers = 2  # residual blocks
        c.model.d_model = 32  # width
        c.model.num_heads = 2  # heads
        if args["pattern"] == "strided":
            c.model.schedule = "local,strided"  # both parts in two layers
        c.batch_size = 2  # images per step
        c.total_steps = 4  # a smoke test
        c.optimizer.lr = 1e-3  # peak learning rate
        c.optimizer.warmup_steps = 1  # linear warmup
        c.log_every = 1  # steps between train-loss lines
        c.eval_every = 2  # steps between validation passes
        c.eval_batches = 1  # validation batches per pass
        c.checkpoint_every = 2  # steps between checkpoints
    return common.finish(c)
