"""The run config: checks of the fields the trainer reads, differences between two configs, the
workdir's record of the config a run trains with (`WORKDIR/config.json`), and the rule for
changing it when a run is resumed.

Resuming a run (a workdir with checkpoints) with a different config: the fields in
`RESUMABLE` may change (how long to train, how often to log, validate and checkpoint, how many
checkpoints to keep, the device mesh, profiling, where the data lives, the attention
implementation, which computes the same numbers; `data.datasets` checks that the data itself
is the same); any other difference is refused with the list of
differences. An allowed change rewrites config.json (the config in effect, which evaluation and
sampling read) and appends {"step", "time", "changes": {field: [old, new]}} to
`WORKDIR/config_history.jsonl`, so how every checkpoint was trained stays on record.

A run config is the `ml_collections.ConfigDict` of a file in `configs/` (see `configs.load`):
trainer fields at the top level, and the sections `optimizer`, `mesh`, `data` (read by
`data.datasets`) and `model` (exactly the fields of `sparse_jax.model.config.ModelConfig`).
"""

from __future__ import annotations

import json
import math
import os
import time

import jax
import ml_collections

from sparse_jax import logs
from sparse_jax.attention import IMPLEMENTATIONS, custom, resolve_implementation
from sparse_jax.data import datasets as data_lib
from sparse_jax.data import sources
from sparse_jax.data.batches import Stage
from sparse_jax.files import append_line, atomic_write, writing
from sparse_jax.model.config import ModelConfig, model_config, named_fingerprint

RECORD = "config.json"  # in the workdir: the config the run trains with
HISTORY = "config_history.jsonl"  # in the workdir: changes of config.json on resume
# Fields that only say where the data lives: they may change when a run is resumed.
LOCATION_FIELDS = ("data.download", "data.data_dir", "data.manual_dir")
# Fields (or sections, ending in ".") that may change when a run is resumed.
RESUMABLE = ("total_steps", "log_every", "eval_every", "eval_batches", "checkpoint_every",
             "keep_checkpoints", "profile_steps", "mesh.", "data.path",
             "model.attention", "model.kernel", *LOCATION_FIELDS)
SECTIONS = ("optimizer", "mesh", "data", "model")  # a config.json without them is not ours
# Fields added after runs were recorded, with the value a record without them trained with.
ADDED = {"context_stages": [], "data.embedded_row_width": 32, "data.embedded_copy_distance": 4,
         "model.rotary": False, "model.shifted_heads": False,
         "model.rotary_fraction": 1.0, "model.kernel": "", "mesh.seq": 1,
         "model.pattern_fingerprint": ""}


MAX_INTEGER = 2**31 - 1  # what a config's integer may be: steps, sizes, seeds are int32s


def check_numbers(config) -> None:
    """ValueError (one line naming the field) for a number of `config` that no field takes: a
    float that is not finite, an integer beyond the int32 the arrays, step counters and seeds
    are held in (checked first, so that no later check builds 10^12 of anything)."""
    for name, value in flat(config).items():
        numbers = value if isinstance(value, (tuple, list)) else (value,)
        for x in numbers:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                continue
            if isinstance(x, float) and not math.isfinite(x):
                raise ValueError(f"config.{name}={value!r} is not a finite number")
            if isinstance(x, int) and abs(x) > MAX_INTEGER:
                raise ValueError(f"config.{name}={value!r}: beyond the limit {MAX_INTEGER:,} "
                                 "(steps, sizes and seeds are int32s)")


def check_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """Validates the fields the trainer reads (ValueError) and returns the ModelConfig."""
    check_numbers(config)
    cfg = model_config(config.model)  # ValueError for an invalid model or pattern
    opt = config.optimizer
    positive = {"total_steps": config.total_steps, "batch_size": config.batch_size,
                "log_every": config.log_every, "eval_every": config.eval_every,
                "checkpoint_every": config.checkpoint_every,
                "keep_checkpoints": config.keep_checkpoints,
                "optimizer.grad_accum": opt.grad_accum}
    for name, value in positive.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{name} must be a positive integer, got {value!r}")
    if not isinstance(config.seed, int) or config.seed < 0:
        raise ValueError(f"config.seed={config.seed!r} must be an integer >= 0")
    if not opt.lr > 0:  # a rate that diverges stops the run at its first non-finite loss
        raise ValueError(f"optimizer.lr={opt.lr!r} must be positive")
    if not 0 <= opt.min_lr_ratio <= 1:
        raise ValueError(f"optimizer.min_lr_ratio={opt.min_lr_ratio!r} must be in [0, 1]")
    if not opt.weight_decay >= 0:
        raise ValueError(f"optimizer.weight_decay={opt.weight_decay!r} must be >= 0")
    for name in ("b1", "b2"):
        if not 0 <= opt[name] < 1:
            raise ValueError(f"optimizer.{name}={opt[name]!r} must be in [0, 1) (Adam's decay "
                             "of its moments)")
    if not 0 <= opt.warmup_steps < config.total_steps:
        raise ValueError(f"optimizer.warmup_steps={opt.warmup_steps} must be in [0, "
                         f"total_steps={config.total_steps}): set --config.optimizer."
                         "warmup_steps to fewer steps than the run has")
    if config.batch_size % opt.grad_accum:
        raise ValueError(f"batch_size={config.batch_size} is not divisible by optimizer."
                         f"grad_accum={opt.grad_accum}")
    if config.batch_size % jax.process_count():
        raise ValueError(f"batch_size={config.batch_size} is not divisible by the "
                         f"{jax.process_count()} processes")
    data = data_lib.data_config(config.data)  # ValueError for a missing path or a bad field
    if data.name == "bytes":  # the file, before any work (a folder, a pipe, a missing file)
        sources.require_file(data.path)
    logs.check_profile_steps(config.profile_steps, config.total_steps)
    context_stages(config, cfg)
    return cfg


def fill_fingerprint(config: ml_collections.ConfigDict, cfg: ModelConfig) -> None:
    """Records a named pattern's fingerprint (``model.pattern_fingerprint``, its index arrays
    at seq_len) in ``config``, so that resuming, evaluating or sampling the run with a changed
    definition is refused (``ModelConfig``) instead of running another pattern."""
    if custom.is_named(cfg.pattern) and not config.model.get("pattern_fingerprint"):
        with config.unlocked():
            config.model.pattern_fingerprint = named_fingerprint(cfg.pattern, cfg.seq_len)


def scaled_warmup(warmup_steps: int, total_steps: int, steps: int) -> int:
    """The warmup of a run of `steps` steps that warms up for the same share of its steps as
    one of `total_steps` does for `warmup_steps`: at least 1 step (if any), fewer than
    `steps`."""
    if warmup_steps <= 0:
        return 0
    return max(0, min(steps - 1, max(1, round(warmup_steps / total_steps * steps))))


def follow_total_steps(config, preset_total_steps: int | None, recorded=None) -> str | None:
    """Warmup that follows how long the run is, when the user did not set it.

    `preset_total_steps`: the total_steps of the config file `config` comes from, given when
    optimizer.warmup_steps is the file's own (no `--config.optimizer.warmup_steps`); None: the
    warmup is the user's, left as it is. `recorded`: the config a run being resumed trained
    with (`read_record`), whose warmup the run keeps, so that resuming never changes its
    schedule. Otherwise a run shortened below the preset (total_steps below
    `preset_total_steps`) warms up for the same share of its steps (`scaled_warmup`), so
    `--config.total_steps=100` runs instead of failing the warmup check. Sets
    config.optimizer.warmup_steps and returns the one line that says so, or None when it is
    unchanged."""
    opt = config.optimizer
    if preset_total_steps is None:
        return None
    preset = opt.warmup_steps
    if recorded is not None and "optimizer" in recorded \
            and isinstance(recorded.optimizer.get("warmup_steps"), int):
        opt.warmup_steps = recorded.optimizer.warmup_steps
        why = "as the run being resumed trained with (a resumed run keeps its schedule)"
    elif 0 < config.total_steps < preset_total_steps:
        opt.warmup_steps = scaled_warmup(preset, preset_total_steps, config.total_steps)
        why = (f"total_steps={config.total_steps} shortens the preset's {preset_total_steps}, so "
               f"warmup keeps the preset's share of the run ({preset / preset_total_steps:.1%}); "
               "set --config.optimizer.warmup_steps to choose it")
    else:
        return None
    if opt.warmup_steps == preset:
        return None
    return f"optimizer.warmup_steps={opt.warmup_steps} instead of the preset's {preset}: {why}"


def context_stages(config, cfg: ModelConfig | None = None) -> tuple[Stage, ...]:
    """config.context_stages as `Stage`s (until, seq_len, batch_size), checked (ValueError, one
    line that shows the expected form): until increasing within (0, total_steps), seq_len
    within [1, model.seq_len), batch sizes as batch_size's rules (a positive multiple of
    grad_accum and of the processes)."""
    cfg = cfg or model_config(config.model)
    given = config.get("context_stages") or ()
    form = "a tuple of (until_step, seq_len, batch_size), e.g. ((2000, 256, 16),)"
    if not isinstance(given, (tuple, list)):
        raise ValueError(f"config.context_stages={given!r} is not {form}")
    stages, previous = [], 0
    for stage in given:
        if not (isinstance(stage, (tuple, list)) and len(stage) == 3 and all(
                isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in stage)):
            raise ValueError(f"config.context_stages: {stage!r} is not (until_step, seq_len, "
                             f"batch_size) of positive integers; the field is {form}")
        stage = Stage(*stage)
        if not previous < stage.until < config.total_steps:
            raise ValueError(f"config.context_stages: until_step {stage.until} must lie after "
                             f"{previous} and before total_steps={config.total_steps}"
                             + ("; set --config.context_stages=() to train at the full context "
                                "throughout, or give stages that end sooner"
                                if stage.until >= config.total_steps else ""))
        if stage.seq_len >= cfg.seq_len:
            raise ValueError(f"config.context_stages: seq_len {stage.seq_len} must be below "
                             f"model.seq_len={cfg.seq_len} (the context of the last stage)")
        if stage.batch_size % config.optimizer.grad_accum or \
                stage.batch_size % jax.process_count():
            raise ValueError(f"config.context_stages: batch_size {stage.batch_size} must be "
                             f"divisible by optimizer.grad_accum={config.optimizer.grad_accum} "
                             f"and the {jax.process_count()} processes")
        stages.append(stage)
        previous = stage.until
    if stages and data_lib.data_config(config.data).is_image:
        raise ValueError("config.context_stages: shorter windows need a byte stream, not "
                         f"images (data.name={config.data.name!r}); set context_stages=()")
    return tuple(stages)


def flat(config) -> dict:
    """{"optimizer.lr": 0.001, ...}: a ConfigDict or its JSON dict as dotted names."""
    def walk(d, prefix):
        for key, value in d.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    d = config if isinstance(config, dict) else json.loads(config.to_json())
    return {**ADDED, **dict(walk(d, ""))}


def differences(old, new, sections: tuple[str, ...] | None = None) -> dict[str, tuple]:
    """{dotted field: (old value, new value)} where two configs differ, ignoring where the data
    lives (LOCATION_FIELDS); only fields under `sections` (e.g. ("model", "data")) if given.
    A field missing on one side shows as "<absent>"."""
    old, new = flat(old), flat(new)
    keys = [k for k in sorted(set(old) | set(new)) if k not in LOCATION_FIELDS
            and (sections is None or k.split(".")[0] in sections)]
    return {k: (old.get(k, "<absent>"), new.get(k, "<absent>")) for k in keys
            if old.get(k, "<absent>") != new.get(k, "<absent>")}


def describe_differences(changed: dict[str, tuple], old_name: str = "in the checkpoint",
                         new_name: str = "now") -> list[str]:
    """Readable lines of `differences`: "model.stride: 16 in the checkpoint, 32 now"."""
    return [f"{k}: {a!r} {old_name}, {b!r} {new_name}" for k, (a, b) in changed.items()]


def write_record(workdir: str, config: ml_collections.ConfigDict) -> str:
    """Writes `config` to WORKDIR/config.json (whole or not at all); returns the path."""
    path = os.path.join(workdir, RECORD)
    with writing(path), atomic_write(path) as f:
        f.write(config.to_json(indent=2))
    return path


def read_record(workdir: str) -> ml_collections.ConfigDict:
    """The config a run in `workdir` trained with (lists become tuples, as in the config files)."""
    path = os.path.join(workdir, RECORD)
    try:
        with open(path) as f:
            raw = json.load(f)
    except ValueError as e:  # not JSON (also UnicodeDecodeError)
        raw = e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is damaged or not a config written by this project "
                         f"({raw if isinstance(raw, ValueError) else 'not a JSON object'}); "
                         "restore it or use another --workdir")
    tuples = lambda d: {k: tuples(v) if isinstance(v, dict) else  # noqa: E731
                        tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return ml_collections.ConfigDict(tuples(raw))


def for_this_machine(config: ml_collections.ConfigDict,
                     attention: str | None = None) -> ml_collections.ConfigDict:
    """A run's recorded config (`read_record`) with the attention implementation chosen where it
    is read (evaluation, sampling): every implementation computes the same numbers, so it is a
    property of the reading machine, not of the run. `attention` (xla | native | pallas | auto)
    when given; else the recorded one, except that a run trained with "native" (the CPU kernels)
    where they cannot run (no compiler, not a CPU) is read with "auto" (XLA on a CPU), and a
    `warning:` line says so. `config` is changed in place and returned."""
    if attention is not None:
        if attention not in IMPLEMENTATIONS:
            raise ValueError(f"attention={attention!r} must be one of {list(IMPLEMENTATIONS)}")
        config.model.attention = attention
    elif config.model.get("attention") == "native":
        try:
            resolve_implementation("native")
        except (ValueError, OSError) as e:
            config.model.attention = "auto"
            logs.warn(f"this run trained with attention='native' (the CPU kernels), which "
                      f"cannot run here ({str(e).splitlines()[0]}); reading it with "
                      f"attention='{resolve_implementation('auto')}', which computes the same "
                      "numbers (--attention= chooses)")
    return config


def resume_changes(saved, config, workdir: str) -> dict[str, tuple]:
    """The differences between the config a run trained with (`saved`) and `config` when they
    are all allowed on resume (`RESUMABLE`); ValueError listing the others otherwise."""
    old, new = flat(saved), flat(config)
    changed = differences(old, new)  # and the data's location, which `differences` ignores:
    changed.update({k: (old.get(k, "<absent>"), new.get(k, "<absent>")) for k in LOCATION_FIELDS
                    if old.get(k, "<absent>") != new.get(k, "<absent>")})
    refused = {k: v for k, v in changed.items()
               if not any(k == r or (r.endswith(".") and k.startswith(r)) for r in RESUMABLE)}
    if refused:
        raise ValueError(
            f"{workdir} holds checkpoints trained with another config; refusing to touch them. "
            f"Differences: {'; '.join(describe_differences(refused))}. On resume only "
            f"{', '.join(RESUMABLE)} may change: use another --workdir, or the config saved "
            f"there ({RECORD}).")
    return changed


def record_changes(workdir: str, config, step: int, changed: dict[str, tuple]) -> None:
    """Appends the allowed changes in effect from `step` to config_history.jsonl, then rewrites
    config.json with `config` (the history line first: a crash between the two leaves the
    change recorded, and the next run finds the same differences)."""
    history = os.path.join(workdir, HISTORY)
    with writing(history):
        append_line(history, {"step": step, "time": round(time.time(), 3),
                              "changes": {k: list(v) for k, v in changed.items()}})
    write_record(workdir, config)

