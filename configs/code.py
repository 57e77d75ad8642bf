r"""Source code (bits per byte): a 512-byte and a 4,096-byte model at equal wall time.

Commands (the shipped corpus data/cpython_lib.py.gz, the Python 3.11 standard library's own
modules, unless --config.data.path names another file; plain or .gz):
  python scripts/train.py --config=configs/code.py:size=short --workdir=workdirs/code_short
  python scripts/train.py --config=configs/code.py:size=long --workdir=workdirs/code_long
  python scripts/evaluate.py --workdir=workdirs/code_long --min_context=3584
Variants: size = short (default) | long; heads = shifted (default) | paper; pattern = strided
(default) | fixed | dense (heads=paper only).
Hardware: a 2-core CPU. Wall time: each preset about 30 minutes from process start
(compilation, validation passes and checkpoints included). Target metric: test bits/byte; on
the shipped corpus's test part (after everything before it) gzip -9 costs 1.903, bzip2 -9
1.544 and xz -9e 1.397 (data/README.md). Measured on a 2-core Xeon, each alone
(docs/long_context/code.md, 2026-11-26): short 1.529 test bits/byte in 28 min 16 s, long
1.468 in 25 min 50 s (below bzip2 -9), 0.061 ahead. On the bytes only a context beyond 512 can
copy the long model pays 0.94-0.96 bits against the short one's 1.06 (both given >= 448-512
bytes of context); on the rest the short one is ahead, so with >= 448 / >= 512 bytes of context
for every byte they are level (1.444 / 1.448).

heads=shifted (default): the same model at both contexts, only the context (and the long
preset's first steps at 512) differ. 6 layers, d=128, 8 heads, 1.26M parameters, with two
things outside the paper:
  - rotary queries and keys on half of each head's features and no absolute position tables
    (the paper's text model learns row and column tables): "k bytes back" is one learned
    direction at every position, and the unrotated half scores a match the same at any
    distance (with all features rotated the long model got worse with more context);
  - shifted heads (ModelConfig.shifted_heads): strided l=8, layers alternating a 9-byte local
    window and the column of every 8th byte back, whose 8 heads read keys and values shifted
    by 1..8 bytes. Together they reach every earlier byte in one hop, and a query matching the
    context before some earlier byte reads the byte that followed it: a copy from anywhere in
    the context, which the paper's patterns reach only through two hops and a summary.
  Nothing is tuned to the shipped corpus; the presets are meant for any source code.
  size=short: context 512, 4,150 steps of 8 windows.
  size=long: context 4,096; 2,000 steps of 8 windows of 512 bytes (cheap steps, where the model
  leaves the bigram plateau and learns to copy), then 1,100 of 2 windows of 4,096 (about half
  the time), where it learns to reach far back.

heads=paper: the first presets, 4 heads and the paper's layouts. size=short: context 512,
strided l=32 with the paper's 33-byte window, merged heads, 2,400 steps. size=long: context
4,096, strided l=64 with the paper's window of l + 1 = 65 bytes (two hops reach every earlier
byte: the paper's criterion; configs/bytes.py:size=cpu_long's 33-byte window reaches only half
the residues mod 64), layers interleaved, 1,400 steps of 8 x 512 then 500 of 2 x 4,096. At 30
CPU minutes neither learned to copy, and the long one read no further back than ~512 bytes.
"""

from configs import common


def get_config(arg=None):
    args = common.parse_args(arg, size=("short", "long"), heads=("shifted", "paper"),
                             pattern=("strided", "fixed", "dense"))
    c = common.base()
    c.data.name = "bytes"  # any file, read as a memory map
    c.data.path = "data/cpython_lib.py.gz"  # the shipped code corpus; --config.data.path=FILE

    c.model.num_layers = 6  # residual blocks
    c.model.d_model = 128  # width
    c.model.pattern = args["pattern"]  # strided: local window + every l-th byte back
    c.model.pos_emb = "none"  # no absolute tables (outside the paper) ...
    c.model.rotary = True  # ... but rotary queries and keys: relative positions (not the paper)
    c.model.attention = "auto"  # on a CPU the fused CPU kernels where they build (else xla)
    c.optimizer.lr = 5e-3  # peak learning rate (configs/bytes.py:size=cpu's)
    c.optimizer.warmup_steps = 200  # linear warmup
    c.optimizer.min_lr_ratio = 0.1  # the cosine ends at lr / 10
    c.log_every = 100  # steps between train-loss lines
    c.eval_batches = -1  # the whole valid split (607K bytes of the shipped corpus)
    if args["heads"] == "shifted":  # the same model at both contexts; only the context differs
        if args["pattern"] != "strided":
            raise ValueError(f"configs/code.py: heads=shifted needs pattern=strided, not "
                             f"{args['pattern']!r}; use heads=paper for the fixed or dense "
                             "pattern")
        c.model.num_heads = 8  # one per shift 1..l: 16 dims each
        c.model.stride = 8  # l: the column holds every 8th byte back (n / 8 keys)
        c.model.local_width = None  # a 9-byte window (l + 1)
        c.model.mode = "interleaved"  # local layers build contexts; column layers look them up
        c.model.shifted_heads = True  # head s reads keys s and values s - 1 further back
        c.model.rotary_fraction = 0.5  # 8 of each head's 16 query/key features unrotated
        if args["size"] == "short":
            c.model.seq_len = 512  # context
            c.batch_size = 8  # windows per step (4,096 bytes)
            c.total_steps = 4150  # optimizer steps (17.0M bytes; the long preset's wall time)
        else:
            c.model.seq_len = 4096  # context: 8x the short preset's
            c.batch_size = 2  # windows per step (8,192 bytes; one per device on 2 cores)
            # A step of 2 x 4,096 takes about two of 8 x 512: 2,000 short steps then 1,100
            # long ones take about the short preset's 4,150 steps' time, half of it at full
            # context (measured: 25 min 50 s against 28 min 16 s).
            c.total_steps = 3100  # optimizer steps
            c.context_stages = ((2000, 512, 8),)  # steps before 2,000: 8 windows of 512 bytes
    else:  # the first presets (4 heads, the paper's strided layouts)
        c.model.num_heads = 4  # heads
        if args["size"] == "short":
            c.model.seq_len = 512  # context
            c.model.stride = 32  # l ~ sqrt(context); local window l + 1 = 33 (paper)
            c.model.c = 8  # summary width of the fixed variant, l / 4 (paper)
            c.model.mode = "merged"  # every head attends both parts
            c.batch_size = 8  # windows per step (4,096 bytes)
            c.total_steps = 2400  # optimizer steps (9.8M bytes, 0.9 passes over the train part)
        else:
            c.model.seq_len = 4096  # context: 8x the short preset's
            c.model.stride = 64  # l = sqrt(context): every 64th byte back
            c.model.c = 16  # summary width of the fixed variant, l / 4 (paper)
            c.model.local_width = None  # the paper's window, l + 1 = 65 bytes: two hops reach all
            c.model.mode = "interleaved"  # layers alternate local and strided (paper §4.3)
            c.batch_size = 2  # windows per step (8,192 bytes; one per device on 2 cores)
            # A step of 2 x 4,096 costs about two of 8 x 512, so 1,400 short steps and 500 long
            # ones take the short preset's 2,400 steps' time; about 40% of it at full context.
            c.total_steps = 1900  # optimizer steps
            c.context_stages = ((1400, 512, 8),)  # steps before 1,400: 8 windows of 512 bytes
    c.eval_every = c.total_steps // 4  # steps between validation passes
    c.checkpoint_every = c.eval_every  # steps between checkpoints
    return common.finish(c)
