"""The table of `tests/bad_flags.py`: for every flag of every script (and every field of the
config tree), the values users mistype and which of them are valid, with the reason.

A flag's entry is its kind, which gives the values tried:

* `Count` (an integer flag) and `Number` (a float flag): 0, -1, a huge value (10^12), nan, inf
  and text; a Count also the largest value the int32 rule lets through (2^31 - 1), which its
  own checks must refuse unless the script can take it;
* `Items` (a list flag): an empty list, an item given twice, an unknown item (and for a list of
  numbers 0, -1 and a huge value as an item);
* `Path` (a file or folder the script reads or writes): empty, a missing path, a regular file
  where a folder is meant, a folder where a file is meant, and a folder that already holds the
  script's output (`holds`);
* `Text`, `Choice` (an enum) and `Switch` (a bool): the values given, an unknown choice, text
  for a bool;
* `Config` (--config): a missing file, a folder, and its argument (`FILE:key=value,...`)
  empty, unknown, misspelled, given twice, without a value, with a space or an empty item.

Every value is expected to be refused in one line that names the flag, unless the entry's `ok`
maps its label to why it is valid. `extra` adds cases of its own ({label: value}), refused
unless `ok` names them too; a value starting with "--" is a whole argument list (several
flags, space-separated).
"""

from __future__ import annotations

import dataclasses
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUGE = "1000000000000"  # 10^12: a length, a count, a million devices and more
MAX32 = "2147483647"  # 2^31 - 1: the largest integer a flag without a bound of its own takes
WEEK = "604800"  # sparse_jax.cli.MAX_SECONDS: the longest time limit, cap or budget accepted
# The labels of accepted values that are extremes: where a script's entry has `work`, each is
# also run into the script's first seconds of work (tests/bad_flags.py), so that a value the
# checks pass but the work cannot take (a wait too long for poll()) is caught.
EXTREMES = ("0", "-1", "huge", "max", "a week", "cap a week")
NUMBERS = {"0": "0", "-1": "-1", "huge": HUGE, "nan": "nan", "inf": "inf", "text": "ten"}


@dataclasses.dataclass
class Case:
    name: str  # "--flag=label"
    flag: str
    value: str
    argv: list  # the script's path, then its flags
    ok: str | None  # why the value is valid; None: it must be refused
    match: str  # a regex (case-insensitive) the one error line must match


@dataclasses.dataclass
class Kind:
    ok: dict = dataclasses.field(default_factory=dict)  # label -> why the value is valid
    extra: dict = dataclasses.field(default_factory=dict)  # label -> value, cases of its own
    match: str | None = None  # the error line's regex (default: the flag's name)

    def values(self) -> dict:
        return {}


class Count(Kind):
    def values(self):
        return {**NUMBERS, "max": MAX32}


class Number(Kind):
    def values(self):
        return dict(NUMBERS)


@dataclasses.dataclass
class Items(Kind):
    item: str = "x"  # a valid item
    numbers: bool = False  # a list of numbers: 0, -1 and a huge value as items too

    def values(self):
        out = {"empty": "", "repeat": f"{self.item},{self.item}", "unknown": "bogus"}
        if self.numbers:
            out.update({"0": "0", "-1": "-1", "huge": HUGE})
        return out


@dataclasses.dataclass
class Path(Kind):
    role: str = "in_file"  # in_file, in_dir, out_file, out_dir
    holds: tuple = ()  # out_dir: the files of a report there (the "output" case)

    def values(self):
        out = {"empty": "", "missing": "{tmp}/absent/path", "file": "{tmp}/a_file",
               "folder": "{tmp}/a_folder"}
        if self.holds:
            out["output"] = "{tmp}/output_{flag}"
        return out


@dataclasses.dataclass
class Text(Kind):
    given: dict = dataclasses.field(default_factory=lambda: {"empty": ""})

    def values(self):
        return dict(self.given)


class Choice(Kind):
    def values(self):
        return {"unknown": "bogus"}


class Switch(Kind):
    def values(self):
        return {"text": "maybe"}


class Multi(Text):
    """A flag given once per item (DEFINE_multi_string)."""


@dataclasses.dataclass
class Config(Kind):
    file: str = "configs/quickstart.py"
    arg: str = "pattern=dense"  # a valid argument

    def __post_init__(self):
        self.ok = {"empty argument": "nothing after the colon: the file's default variant",
                   **self.ok}

    def values(self):
        key = self.arg.split("=")[0]
        f = "{repo}/" + self.file
        return {"missing": "{tmp}/absent.py", "folder": "{tmp}/a_folder",
                "empty argument": f"{f}:", "unknown argument": f"{f}:bogus=1",
                "misspelled argument": f"{f}:{key[:-1]}={self.arg.split('=')[1]}",
                "argument twice": f"{f}:{self.arg},{self.arg}", "no value": f"{f}:{key}=",
                "space in argument": f"{f}:{key} ={self.arg.split('=')[1]}",
                "empty item": f"{f}:{self.arg},",
                "unknown value": f"{f}:{key}=bogus"}


@dataclasses.dataclass
class Script:
    base: list  # a valid command's flags ({tmp}: the case folder, {repo}: the repository)
    flags: dict  # name -> Kind
    config_fields: bool = False  # also every --config.FIELD of the config tree (CONFIG)
    # Flags that make the script's work cheap (a dry run, a toy size): each accepted extreme
    # value (EXTREMES) then also runs into the first seconds of main with them; None: main is
    # not run (its work needs what the case folder does not hold: a trained checkpoint).
    work: list | None = None


def distributed(**ok) -> dict:
    """The entries of the flags of `sharding.define_distributed_flags`."""
    return {
        "cpu_devices": Count(ok={"-1": "one device per core, the default", **ok}),
        "jax_distributed": Switch(),
        "coordinator_address": Text(given={"empty": "", "no port": "host", "bad port":
                                           "host:99999", "alone": "host:1234"}),
        "num_processes": Count(),
        "process_id": Count(),
    }


NEW = "a folder that does not exist yet is created"
EMPTY_FOLDER = "an empty folder is written into"
RUN = {"missing": NEW, "folder": "an empty folder: a new run"}
ANY_FILE = "any file of bytes is read"
NEW_FILE = "its folder is created"

SCRIPTS = {
    "accelerator_report": Script(["--output_dir={tmp}/report"], work=["--dry_run"], flags={
        "output_dir": Path(role="out_dir", holds=("results.md", "results.json", "log.txt"),
                           ok={"missing": NEW, "folder": EMPTY_FOLDER}),
        "wheels": Path(role="in_dir"),
        "dry_run": Switch(),
        "stages": Items(item="env"),
        "budget_s": Number(extra={"a week": WEEK}, ok={
            "a week": "the longest wait accepted (cli.MAX_SECONDS); a budget above the stages' "
                      "caps changes nothing: each stage keeps its own cap"}),
        "caps": Items(item="tests=150", extra={"cap 0": "tests=0", "cap nan": "tests=nan",
                                               "cap huge": f"tests={HUGE}",
                                               "cap a week": f"env={WEEK}"},
                      ok={"cap a week": "the longest wait accepted (cli.MAX_SECONDS): the env "
                                        "stage runs under it"}),
        "profile": Switch(),
        "overwrite": Switch(),
    }),
    "attention_stats": Script(["--workdir={tmp}/run"], {
        "workdir": Path(role="in_dir"),
        "split": Choice(),
        "checkpoint": Text(given={"empty": "", "text": "bogus", "-1": "-1", "absent": "99"}),
        "windows": Count(ok={"max": "more windows than the split holds is refused once the "
                                          "split is read, before any window runs"}),
        "layers": Items(item="0", numbers=True, ok={"0": "layer 0, the first"}),
        "heads": Items(item="0", numbers=True, ok={"0": "head 0, the first"}),
        "bands": Items(item="64", numbers=True),
        "far": Count(ok={"0": "the mass beyond distance 0: every key but the query's own"}),
        "queries": Text(given={"empty": "", "text": "bogus", "short": "1"},
                        ok={"empty": "no queries, as without the flag"}),
        "attention": Choice(),
        "output_dir": Path(role="out_dir", holds=("test_4.json", "test_4.md"),
                           ok={"missing": NEW, "folder": EMPTY_FOLDER}),
        "overwrite": Switch(),
    }),
    "benchmark_attention": Script(["--devices=1", "--output_dir={tmp}/out"], work=[
        "--seq_lens=256", "--patterns=dense", "--passes=fwd", "--repeats=1", "--rounds=1",
        "--heads=1", "--head_dim=8"], flags={
        "seq_lens": Items(item="4096", numbers=True),
        "patterns": Items(item="dense"),
        "passes": Items(item="fwd"),
        "heads": Count(),
        "head_dim": Count(),
        "batch": Count(),
        "dtype": Choice(),
        "devices": Count(),
        "repeats": Count(),
        "rounds": Count(),
        "mem_limit_gb": Number(ok={"huge": "a limit above the machine's memory kills no case"}),
        "baseline_optional": Switch(),
        "output_dir": Path(role="out_dir", holds=("results.json", "results.md"),
                           ok={"missing": NEW, "folder": EMPTY_FOLDER}),
        "overwrite": Switch(),
    }),
    "benchmark_model": Script([], {
        "output": Path(role="out_file", ok={"missing": NEW_FILE}),
        "overwrite": Switch(),
        "seq_len": Items(item="8192", numbers=True),
        "num_layers": Count(),
        "d_model": Count(),
        "num_heads": Count(),
        "stride": Text(given={"empty": "", "text": "bogus", "0": "0", "-1": "-1",
                              "huge": HUGE}),
        "update": Switch(),
        "batch_size": Count(),
        "steps": Count(),
        "seq": Count(extra={"3 (no split of 8192)": "3", "64 (the pattern's rows)": "64",
                            "64 at 4096 (half a row each)": "--seq=64 --seq_len=4096"},
                     ok={"64 (the pattern's rows)": "8192 / 64 = 128 positions a device, the "
                         "stride: a split the runs' check accepts (the default cases ran so)"}),
        "cases": Items(item="strided:none:unrolled"),
        "dtype": Choice(),
        "compile_cifar": Switch(),
    }),
    "benchmark_sampling": Script([], {
        "output": Path(role="out_file", ok={"missing": NEW_FILE}),
        "overwrite": Switch(),
        "num_layers": Count(),
        "d_model": Count(),
        "num_heads": Count(),
        "seq_len": Count(),
        "stride": Count(),
        "length": Count(),
        "batch_size": Count(),
        "naive_steps": Count(ok={"max": "clamped to the sample: min(naive_steps, length - 1)"}),
        "workdir": Path(role="in_dir"),
        "eval": Switch(),
        "eval_mib": Count(),
    }),
    "benchmark_training": Script(["--data={repo}/data/kjv.html.gz"], {
        "seq_lens": Items(item="256", numbers=True),
        "steps": Items(item="100", numbers=True),
        "patterns": Items(item="dense"),
        "baselines": Items(item="eager"),
        "baseline_optional": Switch(),
        "data": Path(role="in_file", ok={"file": ANY_FILE}),
        "cpu_devices": Count(ok={"-1": "one device per core, the default"}),
        "output_dir": Path(role="out_dir", holds=("results.json", "results.md"),
                           ok={"missing": NEW, "folder": EMPTY_FOLDER}),
        "overwrite": Switch(),
    }),
    "build_code_corpus": Script(["--pins={repo}/data/code_corpus_pins.txt",
                                 "--output={tmp}/corpus.py.gz", "--sdists={tmp}/sdists"], {
        "pins": Path(role="in_file"),
        "sdists": Path(role="in_dir", ok={
            "missing": "created, and the missing sdists downloaded into it",
            "folder": "the missing sdists are downloaded into it"}),
        "output": Path(role="out_file", ok={"missing .gz": NEW_FILE},  # a_file: not a .gz
                       extra={"missing .gz": "{tmp}/absent/corpus.py.gz"}),
        "overwrite": Switch(),
        "download": Switch(),
    }),
    "compare_patterns": Script(["--config={repo}/configs/quickstart.py",
                                "--config.data.path={repo}/data/kjv.html.gz",
                                "--workdir={tmp}/study"], {
        "config": Config(),
        "workdir": Path(role="out_dir", holds=("results.json",), ok={
            "missing": NEW, "folder": "an empty folder: a new study",
            "output": "running again reuses the finished patterns and resumes the others"}),
        "patterns": Items(item="dense"),
        "steps": Count(ok={"max": "a long study, not a wrong one: it stops and resumes at any "
                                      "time, as train.py's total_steps"}),
        "minutes": Number(),
        "output_dir": Path(role="out_dir", holds=("results.json", "results.md"), ok={
            "missing": NEW, "folder": EMPTY_FOLDER}),
        "overwrite": Switch(),
    }),
    "compile_report": Script(["--tools={tmp}/gpu_tools", "--programs=ci"], work=[], flags={
        "target": Choice(),
        "programs": Items(item="ci", extra={"dense@cudnn without cuDNN":
                                            "attention 16k dense@cudnn"}),
        "patterns": Items(item="strided:128@pallas"),
        "seq_lens": Items(item="4096", numbers=True),
        "tools": Path(role="in_dir"),
        "output_dir": Path(role="out_dir", holds=("results.md", "results.json"),
                           ok={"missing": NEW, "folder": EMPTY_FOLDER}),
        "overwrite": Switch(),
        "check": Switch(),
        "list": Switch(),
        "timeout_s": Number(extra={"a week": WEEK}, ok={
            "a week": "the longest wait accepted (cli.MAX_SECONDS): every program compiles to "
                      "its end"}),
        "cycles": Switch(),
    }),
    "context_parallel": Script(["--n=1024", "--devices=1,2"], {
        "patterns": Items(item="strided"),
        "stride": Count(ok={"max": "a stride beyond n: the costs of the pattern's local part, "
                                       "as counted (nothing of size stride is built)"}),
        "c": Count(),
        "n": Items(item="1024", numbers=True),
        "devices": Items(item="2", numbers=True),
        "heads": Count(),
        "head_dim": Count(),
        "implementation": Choice(),
        "memory": Switch(),
        "time": Switch(),
        "model_steps": Count(ok={"0": "the default: costs, not the model trained"},
                             extra={"2 steps over 3 devices": "--model_steps=2 --devices=3"}),
        "cpu_devices": Count(),
        "output_dir": Path(role="out_dir", holds=("results.json", "results.md"),
                           ok={"missing": NEW, "folder": EMPTY_FOLDER}),
        "overwrite": Switch(),
    }),
    "cost_model": Script([], {
        "output_json": Path(role="out_file", ok={"missing": NEW_FILE}),
        "overwrite": Switch(),
        "starts": Count(),
        "measured": Items(item="h200_2026-11-28={repo}/docs/benchmarks/h200_2026-11-28/"
                               "report_results.json"),
        "static": Items(item="{repo}/docs/benchmarks/compiled_h100/results.json"),
        "predictions": Path(role="out_file", ok={"missing": NEW_FILE}),
        "patterns": Items(item="fixed:128:32@pallas"),
        "lengths": Items(item="16384", numbers=True),
    }),
    "describe": Script(["--config={repo}/configs/quickstart.py",
                        "--config.data.path={repo}/data/kjv.html.gz"], {
        "config": Config(extra={"a mesh train.py refuses (batch 1 over 2 devices)":
                                "{repo}/configs/enwik8.py:size=million"}),
        "json": Switch(),
        "batch_size": Count(),
        "devices": Count(),
    }),
    "evaluate": Script(["--workdir={tmp}/run"], {
        "workdir": Path(role="in_dir"),
        "split": Choice(),
        "checkpoint": Text(given={"empty": "", "text": "bogus", "-1": "-1", "absent": "99"}),
        "attention": Choice(),
        "min_context": Count(ok={"0": "every position scored, as without the flag"}),
        "batch_size": Count(),
        "overwrite": Switch(),
        "copy_classes": Items(item="512", numbers=True,
                              ok={"empty": "no classes by copy distance (documented)"}),
        "data": Path(role="in_file", ok={"file": ANY_FILE}),
        **distributed(),
    }),
    "image_baselines": Script(["--path={tmp}/pics"], {
        "path": Path(role="in_dir"),
        "split": Choice(),
        "split_fractions": Items(item="0.5", extra={"nan": "nan,0.5,0.5",
                                                    "negative": "1.5,-0.25,-0.25"}),
        "limit": Count(ok={"max": "at most the split is taken: min(limit, pictures)"}),
        "output": Path(role="out_file", ok={"missing": NEW_FILE}),
        "overwrite": Switch(),
    }),
    "plot_pattern": Script(["--output={tmp}/pattern.png"], work=["--seq_len=256"], flags={
        "kind": Choice(),
        "pattern": Text(given={"empty": "", "missing": "no_such_module_xyz:longformer",
                               "unnamed": "longformer"},
                        ok={"empty": "no pattern of one's own: --kind's, the default"}),
        "seq_len": Count(),
        "stride": Count(ok={"max": "a stride beyond --seq_len: its n x n picture shows the "
                                       "local part that is left"}),
        "c": Count(ok={"max": "a summary wider than the block: the picture shows the "
                                  "pattern as its spec clips it"}),
        "local_width": Count(ok={"max": "a window beyond --seq_len: every earlier key, drawn"}),
        "summary": Choice(),
        "summary_block": Count(ok={"0": "the default: no sub-block",
                                   "max": "a sub-block beyond the summary: the whole summary"}),
        "query": Count(ok={"0": "the first query's row"}),
        "output": Path(role="out_file", ok={"missing": NEW_FILE}),
        "overwrite": Switch(),
    }),
    "plot_positions": Script(["--output={tmp}/positions.png", "{tmp}/eval.json"], {
        "output": Path(role="out_file", ok={"missing": NEW_FILE}),
        "overwrite": Switch(),
        "label": Multi(ok={"empty": "an empty legend label is drawn as none"}),
        "title": Text(ok={"empty": "no title, the default"}),
    }),
    "repeats": Script(["--config={repo}/configs/quickstart.py",
                       "--config.data.path={repo}/data/kjv.html.gz"], {
        "config": Config(),
        "split": Choice(),
        "distances": Items(item="64", numbers=True, ok={"0": "0 is unlimited (documented)"}),
        "k": Count(),
        "compressors": Switch(),
        "output": Path(role="out_file", ok={"missing": NEW_FILE}),
        "overwrite": Switch(),
    }),
    "sample": Script(["--workdir={tmp}/run"], {
        "workdir": Path(role="in_dir"),
        "num_samples": Count(),
        "length": Count(),
        "temperature": Number(ok={"0": "greedy decoding (documented)",
                                  "huge": "every byte equally likely: a valid, flat sampler"}),
        "top_k": Count(),
        "top_p": Number(),
        "prompt": Text(ok={"empty": "no prompt: the samples start from a newline, as "
                                    "without the flag"}),
        "prompt_file": Path(role="in_file", ok={"file": "any file of bytes is a prompt"}),
        "seed": Count(ok={"0": "a seed, the default", "max": "a seed (int32)"}),
        "output": Path(role="out_file", ok={"missing": NEW_FILE}),
        "checkpoint": Text(given={"empty": "", "text": "bogus", "-1": "-1", "absent": "99"}),
        "complete": Count(ok={"0": "the default: samples, no completion"}),
        "split": Choice(),
        "attention": Choice(),
        "overwrite": Switch(),
    }),
    "train": Script(["--config={repo}/configs/quickstart.py",
                     "--config.data.path={repo}/data/kjv.html.gz", "--workdir={tmp}/new_run"], {
        "config": Config(extra={
            "a field given twice": "--config.batch_size=4 --config.batch_size=8",
            "a tuple given twice (was: joined)":
                "--config.data.split_fractions=(0.8,0.1,0.1) "
                "--config.data.split_fractions=(0.8,0.1,0.1)"},
            ok={"a field given twice": "the last one wins, as in absl (scripts and tests append "
                                       "an override to a command)"}),
        "workdir": Path(role="out_dir", holds=("config.json", "checkpoints/4/"), ok={
            **RUN, "output": "the run there is resumed"}),
        **distributed(),
    }, config_fields=True),
}

# The config tree's fields (configs/common.py), tried through scripts/train.py. An int field
# gets the values of `Count`, a float field `Number`'s, a string field "" and "bogus", a bool
# "maybe", a tuple "()", "bogus" and "(1,)", a path field `Path`'s.
FIELD_TUPLE = {"empty": "()", "text": "bogus", "short": "(1,)"}
FIELD_TEXT = {"empty": "", "unknown": "bogus"}
IGNORED = "read by cifar10 only: a run of bytes ignores it"
LONG = "a long run, not a wrong one: it checkpoints, stops and resumes at any time"
RARE = "an interval longer than the run: a count compared with the step, nothing allocated"
CONFIG = {
    "seed": Count(ok={"0": "a seed", "max": "a seed (int32)"}),
    "total_steps": Count(ok={"max": LONG}),
    "batch_size": Count(),
    "log_every": Count(ok={"max": RARE}),
    "eval_every": Count(ok={"max": RARE}),
    "eval_batches": Count(ok={"max": "at most every batch of the split is read",
                              "0": "<= 0: every batch (documented)",
                              "-1": "<= 0: every batch (documented)"}),
    "checkpoint_every": Count(ok={"max": RARE}),
    "keep_checkpoints": Count(ok={"max": "every checkpoint kept: a count, nothing allocated"}),
    "profile_steps": Text(given=FIELD_TUPLE, ok={"empty": "(): no profile, the default"}),
    "context_stages": Text(given=FIELD_TUPLE, ok={"empty": "(): the full context throughout"}),
    "optimizer.lr": Number(ok={"huge": "any positive rate is AdamW's; one that diverges stops "
                                       "the run at its first non-finite loss, naming the last "
                                       "good checkpoint (bad_inputs.py's nan/ cases)"}),
    "optimizer.warmup_steps": Count(ok={"0": "no warmup"}),
    "optimizer.min_lr_ratio": Number(ok={"0": "the cosine decays to 0"}),
    "optimizer.weight_decay": Number(ok={"0": "no weight decay", "huge": "as a huge lr: a run "
                                         "that diverges stops at its first non-finite loss"}),
    "optimizer.grad_clip": Number(ok={"0": "<= 0: no clipping (documented)",
                                      "-1": "<= 0: no clipping (documented)",
                                      "huge": "a bound no gradient reaches: no clipping"}),
    "optimizer.b1": Number(ok={"0": "no momentum"}),
    "optimizer.b2": Number(ok={"0": "the second moment of the last step only"}),
    "optimizer.grad_accum": Count(),
    "mesh.data": Count(ok={"-1": "every device the other axes leave (documented)"}),
    "mesh.fsdp": Count(),
    "mesh.seq": Count(),
    "data.name": Text(given=FIELD_TEXT),
    "data.path": Path(role="in_file", ok={"file": ANY_FILE}),
    "data.download": Switch(),
    "data.data_dir": Path(role="in_dir", ok={k: IGNORED for k in ("missing", "file", "folder")}),
    "data.manual_dir": Path(role="in_dir", ok={k: IGNORED for k in ("missing", "file",
                                                                     "folder")}),
    "data.split_fractions": Text(given=FIELD_TUPLE),
    "data.seed": Count(ok={"0": "a seed, the default", "max": "a seed (int32)"}),
    "data.embedded_bytes": Count(ok={"max": "a 2 GiB stream: minutes to generate, and it fits "
                                            "here (setup.complete refuses one that does not)"}),
    "data.embedded_seed": Count(ok={"0": "a seed, the default", "max": "a seed (int32)"}),
    "data.embedded_row_width": Count(),
    "data.embedded_copy_distance": Count(ok={"max": "no row is a copy: a stream without "
                                                             "long-range structure"}),
    "model.vocab_size": Count(),
    "model.seq_len": Count(),
    "model.num_layers": Count(),
    "model.d_model": Count(),
    "model.num_heads": Count(),
    "model.ff_mult": Number(),
    "model.qk_ratio": Number(),
    "model.dropout": Number(ok={"0": "no dropout, the default"}),
    "model.pattern": Text(given=FIELD_TEXT),
    "model.pattern_fingerprint": Text(given=FIELD_TEXT,
                                      ok={"empty": "nothing recorded, the default"}),
    "model.stride": Count(),
    "model.c": Count(ok={"max": "read by the fixed pattern only: quickstart is strided"}),
    "model.local_width": Count(),
    "model.summary": Text(given=FIELD_TEXT),
    "model.mode": Text(given=FIELD_TEXT),
    "model.schedule": Text(given=FIELD_TEXT, ok={"empty": "no schedule, the default"}),
    "model.distinct_summaries": Switch(),
    "model.pos_emb": Text(given=FIELD_TEXT),
    "model.rotary": Switch(),
    "model.rotary_fraction": Number(),
    "model.shifted_heads": Switch(),
    "model.image_shape": Text(given=FIELD_TUPLE),
    "model.remat": Text(given=FIELD_TEXT),
    "model.scan_layers": Switch(),
    "model.dtype": Text(given=FIELD_TEXT),
    "model.param_dtype": Text(given=FIELD_TEXT),
    "model.attention": Text(given=FIELD_TEXT),
    "model.kernel": Text(given=FIELD_TEXT, ok={"empty": "the backend's default, the default"}),
}


def config_fields() -> list[str]:
    """Every field of the config tree (configs/common.py), dotted."""
    from configs import common

    def walk(d, prefix=""):
        for key, value in d.items():
            if hasattr(value, "items") and not isinstance(value, (str, tuple)):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield prefix + key
    return list(walk(common.base()))


def _argv(script: str, base: list, flag: str, value: str, tmp: str) -> list:
    """`base` with --`flag` given `value` (its own occurrences in `base` removed; a value
    starting with "--" is a list of whole flags)."""
    fill = lambda a: a.replace("{tmp}", tmp).replace("{repo}", ROOT).replace(  # noqa: E731
        "{flag}", flag.replace(".", "_"))
    given = [fill(v) for v in value.split(" --")] if value.startswith("--") else \
        [f"--{flag}={fill(value)}"]
    given = [g if g.startswith("--") else "--" + g for g in given]
    out = [fill(a) for a in base]
    own = {a.split("=")[0] for a in out}
    for g in given:  # in the place of the base command's own (--config comes before overrides)
        name = g.split("=")[0]
        if name in own:
            own.discard(name)
            at = [i for i, a in enumerate(out) if a.split("=")[0] == name]
            out[at[0]] = g
            out = [a for i, a in enumerate(out) if i not in at[1:]]
        else:
            out.append(g)
    return [os.path.join(ROOT, "scripts", f"{script}.py"), *out]


def cases(script: str, entry: Script, tmp: str) -> list[Case]:
    """The cases of `script`: its base command (accepted), then every flag's values."""
    out = [Case("base command", "", "", _argv(script, entry.base, "", "", tmp)[:-1],
                "the table's valid command", "")]
    kinds = list(entry.flags.items())
    if entry.config_fields:
        kinds += [(f"config.{name}", kind) for name, kind in CONFIG.items()]
    for flag, kind in kinds:
        for label, value in {**kind.values(), **kind.extra}.items():
            match = kind.match or (flag.split(".")[-1] if flag.startswith("config.") else flag)
            out.append(Case(f"--{flag}={label}", flag, label,
                            _argv(script, entry.base, flag, value, tmp), kind.ok.get(label),
                            match))
    return out


def make_fixtures(tmp: str) -> None:
    """The case folder: a_file, a_folder/, run/ (a trained run's record), pics/, gpu_tools/,
    eval.json."""
    os.makedirs(os.path.join(tmp, "a_folder"))
    with open(os.path.join(tmp, "a_file"), "w") as f:
        f.write("some text\n" * 100)
    os.makedirs(os.path.join(tmp, "gpu_tools", "jax_plugins", "xla_cuda12"))
    os.makedirs(os.path.join(tmp, "gpu_tools", "nvidia", "cuda_nvcc", "bin"))
    open(os.path.join(tmp, "gpu_tools", "nvidia", "cuda_nvcc", "bin", "ptxas"), "w").close()
    with open(os.path.join(tmp, "eval.json"), "w") as f:
        json.dump({"position_curve": [[1, 8.0]], "bits": 2.0}, f)
    import bad_inputs

    for i in range(4):
        path = os.path.join(tmp, "pics", "ab"[i % 2], f"{i}.png")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(bad_inputs.picture(seed=i))
    run = os.path.join(tmp, "run")
    os.makedirs(os.path.join(run, "checkpoints", "4"))
    import configs
    from sparse_jax.run import config as config_lib

    config = configs.load("quickstart", {"data.path": os.path.join(ROOT, "data", "kjv.html.gz")})
    config_lib.write_record(run, config)


def prepare(cases: list[Case], entry: Script, tmp: str) -> None:
    """The "output" folders the cases name, each holding the files of a report (a name ending
    in / is a folder; a config.json is the run fixture's: the folder holds a run)."""
    import shutil

    for case in cases:
        if case.value != "output":
            continue
        folder = os.path.join(tmp, f"output_{case.flag.replace('.', '_')}")
        for name in getattr(entry.flags.get(case.flag), "holds", ()):
            path = os.path.join(folder, name)
            os.makedirs(path if name.endswith("/") else os.path.dirname(path), exist_ok=True)
            if name == "config.json":
                shutil.copyfile(os.path.join(tmp, "run", "config.json"), path)
            elif not name.endswith("/"):
                with open(path, "w") as f:
                    f.write("{}" if name.endswith(".json") else "a report\n")
