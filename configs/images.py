r"""Any folder of same-size PNG or JPEG pictures (bits per dim): a CPU preset and a smoke test.

Command (the folder is searched recursively; train/ and test/ subfolders are the splits if
present, else a fixed-seed split by --config.data.split_fractions; see sparse_jax/data/images.py):
  python scripts/train.py --config=configs/images.py:size=cpu --workdir=workdirs/images_cpu \
      --config.data.path=/work/data/cifar10_jpeg
  python scripts/evaluate.py --workdir=workdirs/images_cpu --split=test
  python scripts/sample.py --workdir=workdirs/images_cpu --complete=8
The first run decodes the pictures once into <folder>.sparse_jax/pixels.npy (CIFAR-10's 60,000
JPEGs: seconds); later runs map that file. The model's picture shape comes from the pictures:
model.image_shape = (H, W, C), seq_len = H*W*C, stride = W*C (one row of sub-pixels) and the
fixed variant's c = stride / 4, each unless set with --config.model.*; the run's first line
says what it chose (sparse_jax.data.images.fill_model_shape). CIFAR-10: (32, 32, 3), 3,072, 96, 24.
Variants: pattern = strided (default) | fixed | dense; size = cpu (default) | tiny.

size=cpu: sized for a 2-core CPU and a 30-minute budget on 50,000 pictures of 32 x 32 x 3:
  4 layers, d=128, 2 heads, half-size feed-forward and query/key (paper), merged strided
  attention with l=96 (each head sees the last 97 sub-pixels and the same sub-pixel of every
  row above), 0.54M parameters, 2,400 steps of 8 pictures (19,200 pictures: 0.4 of an epoch of
  CIFAR-10's 48,000). Hardware: a 2-core CPU. Measured on a 2-core AMD EPYC (AVX-512), nothing
  else running, on the public JPEG copy of CIFAR-10: wall time 29 min 10 s from process start
  (decoding cache, compilation, four validation passes of 256 pictures and checkpoints), test
  3.974 bits/dim over the 10,000 test pictures, against lossless PNG 5.985 and lossless WebP
  4.179 on the same decoded pictures (scripts/image_baselines.py). The copy is lossy, so these
  figures are not comparable with the paper's 2.80 bits/dim on the original pictures.
  Target: at least 1 bit/dim below lossless PNG in 30 minutes (reached: 2.01 below).
size=tiny: 2 layers, d=32, 4 steps of 2 pictures: a smoke test that runs in seconds on a 2-core
  CPU (the loss barely moves).
"""

from configs import (
    cifar10,  # the image model (shape, position tables, stride, half-size layers) and size=tiny
    common,
)


def get_config(arg=None):
    args = common.parse_args(arg, pattern=("strided", "fixed", "dense"), size=("cpu", "tiny"))
    c = cifar10.get_config(f"pattern={args['pattern']},size=tiny")  # pictures of 32 x 32 x 3
    c.data.name = "images"  # a folder of pictures: --config.data.path=FOLDER
    # train / valid / test of a folder without train/ and test/; with them, valid is this share
    # of train/ (CIFAR-10: 2,000 of 50,000, as the paper's 48,000 / 2,000 / 10,000)
    c.data.split_fractions = (0.92, 0.04, 0.04)
    # From the pictures when the run starts (images.fill_model_shape), unless overridden:
    c.model.image_shape = ()  # (rows, columns, channels)
    c.model.seq_len = 0  # rows x columns x channels sub-pixels
    c.model.stride = 0  # l: one row of sub-pixels
    c.model.c = 0  # summary width of the fixed variant: l / 4
    if args["size"] == "tiny":
        return c
    c.model.schedule = common.base().model.schedule  # every layer alike (mode below)
    c.model.num_layers = 4  # residual blocks
    c.model.d_model = 128  # width
    c.model.num_heads = 2  # heads (paper, CIFAR-10)
    c.model.mode = "merged"  # every head attends both parts
    c.model.attention = "auto"  # on a CPU the fused CPU kernels where they build (else xla)
    c.batch_size = 8  # pictures per step (24,576 sub-pixels; 4 per core)
    c.total_steps = 2400  # optimizer steps
    c.optimizer.lr = 3e-3  # peak learning rate (small model, short run)
    c.optimizer.warmup_steps = 100  # linear warmup
    c.optimizer.min_lr_ratio = 0.1  # the cosine ends at lr / 10
    c.log_every = 50  # steps between train-loss lines
    c.eval_every = 600  # steps between validation passes
    c.eval_batches = 32  # 256 valid pictures per pass during training
    c.checkpoint_every = 600  # steps between checkpoints
    return c
