"""Fields every training config shares, and the parser of config arguments.

Not a config itself: `enwik8.py`, `cifar10.py`, `bytes.py`, `images.py` and `quickstart.py`
import it (`from configs import common`) and set what differs. `base()` returns an unlocked
ConfigDict with every field the trainer (`sparse_jax.run.config.check_config`), the data
(`data.datasets.DataConfig`) and the model (`model.transformer.ModelConfig`) read; the config
files call `finish()` on it, which locks it so a mistyped override fails.
"""

import difflib

import ml_collections
from ml_collections import config_dict


class Args(dict):
    """The variant choices of a config argument (key -> value, defaults filled in); `given`:
    the keys the argument itself named (a config may treat a key it was given differently
    from its default, as enwik8's size=million does pattern)."""

    given: frozenset = frozenset()


def parse_args(arg: str | None, **choices: tuple[str, ...]) -> Args:
    """`"pattern=strided,size=tiny"` -> {"pattern": "strided", "size": "tiny"}, strictly: the
    one parser of every config file's argument, so that nothing in it is dropped or read twice.

    `choices` maps each accepted key to its allowed values, the first being the default.
    Unknown keys (with the nearest accepted one), unknown values, keys given twice, empty items
    (",," or a trailing comma), whitespace anywhere and malformed items raise ValueError.
    """
    values = Args({key: allowed[0] for key, allowed in choices.items()})
    given = set()
    if arg and any(ch.isspace() for ch in arg):
        raise ValueError(f"config argument {arg!r} holds a space; write key=value,key=value "
                         "without spaces")
    items = arg.split(",") if arg else []
    if "" in items:
        raise ValueError(f"config argument {arg!r} has an empty item; separate the key=value "
                         "items by single commas")
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"config argument {item!r} is not key=value (got {arg!r})")
        if key not in choices:
            accepted = ", ".join(f"{k}={'|'.join(v)}" for k, v in choices.items())
            near = difflib.get_close_matches(key, choices, n=1)
            raise ValueError(f"unknown config argument {key!r} in {arg!r}"
                             + (f" (did you mean {near[0]!r}?)" if near else "")
                             + f"; accepted: {accepted}")
        if value not in choices[key]:
            raise ValueError(f"{key}={value!r} is not one of {list(choices[key])}")
        if key in given:
            raise ValueError(f"config argument {key!r} given twice in {arg!r}; give it once")
        given.add(key)
        values[key] = value
    values.given = frozenset(given)  # the keys the argument named
    return values


def base() -> ml_collections.ConfigDict:
    """Every field, with defaults that the config files override."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # parameter initialization and dropout randomness
    c.total_steps = 1000  # optimizer steps of the whole run (also the end of the cosine decay)
    c.batch_size = 16  # global batch in sequences per optimizer step, over all devices and hosts
    c.log_every = 50  # steps between train-loss lines, metrics.jsonl rows and TensorBoard points
    c.eval_every = 500  # steps between validation passes (bits on the valid split)
    c.eval_batches = 20  # at most this many global batches per validation pass (<= 0: all)
    c.checkpoint_every = 500  # steps between checkpoints (also one at every validation and the end)
    c.keep_checkpoints = 2  # most recent checkpoints kept, plus the best by validation bits
    c.profile_steps = ()  # (first, last): profiler trace of these steps in WORKDIR/profile; (): off
    # ((until_step, seq_len, batch_size), ...): steps before until_step train on shorter windows
    # (byte streams), the rest on batch_size x model.seq_len; (): the full context throughout
    c.context_stages = ()

    c.optimizer = ml_collections.ConfigDict()  # AdamW with warmup and cosine decay (paper §6)
    c.optimizer.lr = 3.5e-4  # peak learning rate of AdamW (paper: 3.5e-4 on CIFAR-10)
    c.optimizer.warmup_steps = 100  # linear warmup from 0 to lr, then cosine decay
    c.optimizer.min_lr_ratio = 0.0  # the cosine ends at lr * min_lr_ratio at total_steps
    c.optimizer.weight_decay = 0.01  # decoupled weight decay on matrices (not biases, norms)
    c.optimizer.grad_clip = 1.0  # clip the global gradient norm to this (<= 0: no clipping)
    c.optimizer.b1 = 0.9  # Adam beta1
    c.optimizer.b2 = 0.95  # Adam beta2 (not given in the paper)
    c.optimizer.grad_accum = 1  # micro-batches per step (batch_size / grad_accum each)

    c.mesh = ml_collections.ConfigDict()  # devices: a (data, fsdp, seq) mesh
    c.mesh.data = -1  # data-parallel devices (-1: all devices / (fsdp x seq))
    c.mesh.fsdp = 1  # parameter-sharding devices (FSDP: parameters split along the width)
    c.mesh.seq = 1  # context-parallel devices: each sequence's positions split over them

    c.data = ml_collections.ConfigDict()  # sparse_jax.data.datasets.DataConfig: exactly its fields
    c.data.name = "embedded"  # enwik8 | bytes | cifar10 | images | embedded
    # enwik8: raw file or .zip; "bytes": a file (.gz ok); "images": a folder of pictures
    c.data.path = config_dict.placeholder(str)
    c.data.download = False  # enwik8, cifar10: fetch a missing archive (needs network)
    c.data.data_dir = config_dict.placeholder(str)  # TFDS data dir for cifar10 (None: TFDS default)
    c.data.manual_dir = config_dict.placeholder(str)  # where cifar-10-binary.tar.gz is (cifar10)
    c.data.split_fractions = (0.9, 0.05, 0.05)  # train/valid/test of bytes, embedded, images
    c.data.seed = 0  # training order (windows / epoch permutations)
    c.data.embedded_bytes = 2**21  # size of the generated "embedded" stream
    c.data.embedded_seed = 0  # generator seed of the "embedded" stream
    c.data.embedded_row_width = 32  # its rows' bytes (newline included)
    c.data.embedded_copy_distance = 4  # rows back a copied row repeats (D = 4 x 32 = 128 bytes)

    c.model = ml_collections.ConfigDict()  # model.transformer.ModelConfig: exactly its fields
    c.model.vocab_size = 256  # byte values
    c.model.seq_len = 1024  # context n (training windows, image size)
    c.model.num_layers = 2  # residual blocks
    c.model.d_model = 128  # width d
    c.model.num_heads = 4  # attention heads
    c.model.ff_mult = 4.0  # feed-forward width / d (2.0: the paper's half-size)
    c.model.qk_ratio = 1.0  # query/key width / d (0.5: the paper's half-size)
    c.model.dropout = 0.0  # at the end of each residual branch
    # dense | local | strided | fixed, or one of your own: "module:name" or
    # "module:name(k=v, ...)", a module on the path (docs/custom_patterns.md)
    c.model.pattern = "strided"
    # a named pattern's index arrays at seq_len, filled in and recorded when a run starts: a
    # resume, evaluation or sample with a changed definition is refused
    c.model.pattern_fingerprint = ""
    c.model.stride = 32  # l, the pattern's stride / block (also the text position grid width)
    c.model.c = 8  # summary width of "fixed"
    c.model.local_width = config_dict.placeholder(int)  # local window (None: stride + 1, paper)
    c.model.summary = "paper"  # fixed summary convention: paper | lra
    c.model.mode = "merged"  # merged | interleaved | multihead (paper §4.3)
    # parts cycled over layers, e.g. "local,local,local,strided" (mode merged)
    c.model.schedule = ""
    c.model.distinct_summaries = False  # fixed + multihead: each head group its own summary block
    # image (row, column, channel) | text (row, column of grid) | single | none
    c.model.pos_emb = "text"
    c.model.rotary = False  # rotary embedding of queries and keys (relative; not in the paper)
    c.model.rotary_fraction = 1.0  # share of each head's query/key features rotated
    # strided only: column heads read keys/values 1..l bytes back, so that together they reach
    # every earlier byte in one hop (needs >= l heads on the column; not in the paper)
    c.model.shifted_heads = False
    c.model.image_shape = (32, 32, 3)  # (rows, columns, channels): pos_emb "image", image data
    c.model.remat = "none"  # none | full | dots: recompute blocks in the backward pass
    c.model.scan_layers = False  # jax.lax.scan over layers (faster compile of deep models)
    c.model.dtype = "float32"  # compute dtype: float32 | bfloat16 (params stay param_dtype)
    c.model.param_dtype = "float32"  # storage dtype of the (master) parameters
    # sparse attention: xla | native (fused C++ kernels on a CPU, built on first use) | pallas
    # (fused kernels; GPU or TPU, interpret mode on a CPU: slow) | auto (native on a CPU where it
    # builds, else xla; pallas on a GPU or TPU); the same numbers, so it may change on resume.
    # Every preset for real training sets auto: the CPU presets (quickstart, bytes and images
    # size=cpu) and the accelerator ones (enwik8 and cifar10 paper and small, bytes size=gpu),
    # where Pallas measured 2.3-119x the XLA path on an H200 (docs/benchmarks/h200).
    c.model.attention = "xla"
    # the Pallas kernel's options (kernel.BlockSizes.parse): "" the backend's default tiles and
    # variant, or e.g. "chained:h2" (docs/attention.md, "Kernel variants"); the same numbers,
    # so it may change on resume
    c.model.kernel = ""
    return c


def finish(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Locks the config: overriding a field that does not exist (a typo) raises."""
    config.lock()
    return config
