r"""enwik8 (bits per byte), paper §7 / docs/design.md §5: 30 layers, d=512, 8 heads, fixed pattern
l=128, c=32, merged heads, context 12,288, dropout 0.40; 95M parameters.

Command (the archive is read from data/enwik8.zip unless --config.data.path says otherwise):
  python scripts/train.py --config=configs/enwik8.py --workdir=workdirs/enwik8
Variants are config arguments, e.g.
  python scripts/train.py --config=configs/enwik8.py:pattern=strided,size=small --workdir=...
  pattern = fixed (default, paper) | strided (l=128) | dense   (paper Table 2)
  size    = paper (default) | small | tiny | million

size=paper: 16 x 12,288 bytes per step for 36,621 steps = 80 epochs of the 90M training bytes.
  Hardware: GPUs (bfloat16 compute, full remat), e.g. 8 x H100. Wall time: not measured yet; the
  run is ~6.2e18 training FLOPs (~8.2e18 with remat), i.e. about 3 h on 8 GPUs that sustain
  100 TFLOP/s each. Target: 0.99 bits/byte on test (paper; Table 2: fixed 0.99, dense 1.00,
  strided 1.13).
size=small: 12 layers, d=256, context 2,048, 20,000 steps of 16 windows (~7 epochs). One GPU;
  wall time and bits/byte not measured yet.
size=million: the paper's width (d=512, 8 heads) at a context of 1,048,576 bytes on one 80 GB
  GPU: strided (the default here; fixed's n·c/l summary keys per query and dense's n² do not
  fit a million), l = 1,024 (~sqrt(n)), 20 layers, bfloat16, full remat, scanned layers, the
  chained kernels (no layout copies), one window per step, no dropout. Hardware: one H100
  (80 GB); XLA plans its step at 75.6 GB for an H100, planned on a CPU (python
  scripts/compile_report.py --programs=million); the paper's 30 layers plan 101 GB (2.2 GB a
  layer, most of it the layer's float32 input kept for the backward): split the window over
  two GPUs (--config.mesh.seq=2 --config.model.num_layers=30). Let JAX take the GPU's memory
  (XLA_PYTHON_CLIENT_MEM_FRACTION=0.95; its default is 75%). Wall time and bits/byte not
  measured yet.
size=tiny: 2 layers, d=64, context 256, 20 steps of 4 windows: a smoke test that runs in seconds
  on a 2-core CPU (the loss barely moves).
"""

from configs import common


def get_config(arg=None):
    args = common.parse_args(arg, pattern=("fixed", "strided", "dense"),
                             size=("paper", "small", "tiny", "million"))
    if args["size"] == "million":
        if "pattern" not in args.given:
            args["pattern"] = "strided"
        elif args["pattern"] != "strided":
            raise ValueError(f"size=million trains pattern=strided: {args['pattern']}'s keys per "
                             "query grow with n (fixed: n·c/l summary keys; dense: n) and do not "
                             "fit a million bytes")
    c = common.base()
    c.data.name = "enwik8"  # the standard enwik8.zip, split 90M / 5M / 5M
    c.data.path = "data/enwik8.zip"  # raw file or archive (unpacked next to it on first use)

    c.model.pattern = args["pattern"]  # fixed (paper) | strided | dense
    c.model.pos_emb = "text"  # row and column of the (n / l, l) grid
    c.model.mode = "merged"  # every head attends the union of both parts (paper, enwik8)
    if args["size"] == "paper":
        c.model.seq_len = 12288  # context (paper)
        c.model.num_layers = 30  # paper
        c.model.d_model = 512  # paper
        c.model.num_heads = 8  # paper
        c.model.dropout = 0.4  # paper
        c.model.stride = 128  # l (paper)
        c.model.c = 32  # summary width (paper)
        c.model.remat = "full"  # recompute blocks in the backward pass (paper)
        c.model.dtype = "bfloat16"  # mixed precision, float32 master weights
        c.model.attention = "auto"  # the Pallas kernel on a GPU or TPU (docs/benchmarks/h200)
        c.batch_size = 16  # not given in the paper: 2 per GPU on its 8-GPU node
        c.total_steps = 36621  # 80 epochs (paper) of 90M bytes / (16 x 12,288)
        c.optimizer.lr = 3.5e-4  # not given for enwik8 in the paper; its CIFAR-10 value
        c.optimizer.warmup_steps = 5000  # paper
        c.log_every = 100  # steps between train-loss lines
        c.eval_every = 1000  # steps between validation passes
        c.eval_batches = -1  # the whole 5M-byte valid split (26 batches of 16 windows)
        c.checkpoint_every = 1000  # steps between checkpoints
    elif args["size"] == "million":
        c.model.seq_len = 1048576  # context: 2^20 bytes
        c.model.num_layers = 20  # 30 (paper) plan 101 GB: one 80 GB GPU fits 20
        c.model.d_model = 512  # paper
        c.model.num_heads = 8  # paper
        c.model.stride = 1024  # l ~ sqrt(n)
        c.model.kernel = "chained"  # 7.5 GB less than the terms variant's layout copies
        c.model.c = 256  # l / 4 (unused by strided)
        c.model.remat = "full"  # recompute blocks in the backward pass
        c.model.scan_layers = True  # one compiled block
        c.model.dtype = "bfloat16"  # mixed precision, float32 master weights
        c.model.attention = "auto"  # the Pallas kernel on a GPU or TPU
        c.batch_size = 1  # one window of 2^20 bytes per step
        c.total_steps = 6900  # ~80 epochs of 90M bytes, as the paper's run
        c.optimizer.lr = 3.5e-4  # the paper preset's
        c.optimizer.warmup_steps = 500  # linear warmup
        c.log_every = 10  # steps between train-loss lines
        c.eval_every = 200  # steps between validation passes
        c.eval_batches = 4  # 4 windows of the 5M valid bytes
        c.checkpoint_every = 200  # steps between checkpoints
    elif args["size"] == "small":
        c.model.seq_len = 2048  # context
        c.model.num_layers = 12  # residual blocks
        c.model.d_model = 256  # width
        c.model.num_heads = 4  # heads
        c.model.dropout = 0.1  # less than the paper's 0.4: a shorter run overfits less
        c.model.stride = 64  # l ~ sqrt(n)
        c.model.c = 16  # summary width, l / 4 as in the paper
        c.model.dtype = "bfloat16"  # mixed precision, float32 master weights
        c.model.attention = "auto"  # the Pallas kernel on a GPU or TPU (docs/benchmarks/h200)
        c.batch_size = 16  # windows per step
        c.total_steps = 20000  # ~7 epochs
        c.optimizer.lr = 6e-4  # peak learning rate
        c.optimizer.warmup_steps = 1000  # linear warmup
        c.log_every = 100  # steps between train-loss lines
        c.eval_every = 1000  # steps between validation passes
        c.eval_batches = 40  # 40 x 16 x 2,048 bytes = 1.3M of the 5M valid bytes
        c.checkpoint_every = 1000  # steps between checkpoints
    else:  # tiny
        c.model.seq_len = 256  # context
        c.model.num_layers = 2  # residual blocks
        c.model.d_model = 64  # width
        c.model.num_heads = 2  # heads
        c.model.stride = 16  # l ~ sqrt(n)
        c.model.c = 4  # summary width, l / 4 as in the paper
        c.batch_size = 4  # windows per step
        c.total_steps = 20  # a smoke test
        c.optimizer.lr = 1e-3  # peak learning rate
        c.optimizer.warmup_steps = 5  # linear warmup
        c.log_every = 5  # steps between train-loss lines
        c.eval_every = 10  # steps between validation passes
        c.eval_batches = 2  # validation batches per pass
        c.checkpoint_every = 10  # steps between checkpoints
    return common.finish(c)
