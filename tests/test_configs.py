"""Every config file and variant loads, is locked, builds a ModelConfig and passes the trainer's
checks; config arguments and command-line overrides reject typos and wrong types; the one loader
(`configs.load`) reads names, paths and files outside the package as the command line does."""

import ast
import glob
import importlib
import itertools
import os

import pytest
from absl import flags
from ml_collections import config_flags

import configs
from sparse_jax import cli
from sparse_jax.model.config import ModelConfig, model_config
from sparse_jax.run.config import check_config, follow_total_steps, scaled_warmup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
HELPERS = {"common.py", "__init__.py"}  # shared code and the loader, not configs
VARIANTS = {
    "enwik8.py": {"pattern": ["fixed", "strided", "dense"],
                  "size": ["paper", "small", "tiny", "million"]},
    "bytes.py": {"pattern": ["strided", "fixed", "dense"],
                 "size": ["cpu", "cpu_long", "gpu", "paper", "small", "tiny"]},
    "code.py": {"size": ["short", "long"], "heads": ["shifted", "paper"],
                "pattern": ["strided", "fixed", "dense"]},
    "cifar10.py": {"pattern": ["strided", "fixed", "dense"],
                   "size": ["paper", "small", "mini", "tiny"]},
    "images.py": {"pattern": ["strided", "fixed", "dense"], "size": ["cpu", "tiny"]},
    "quickstart.py": {"pattern": ["strided", "dense", "fixed", "local"],
                      "data": ["kjv", "embedded"]},
}


def load(name):
    return importlib.import_module(f"configs.{name[:-3]}")


def refused(name, arg):
    """Combinations a config file refuses (with a ValueError that says what to use instead)."""
    return ("pattern=strided" not in arg
            and (name == "code.py" and "heads=shifted" in arg or "size=million" in arg))


def variants(name):
    keys = sorted(VARIANTS[name])
    for values in itertools.product(*(VARIANTS[name][k] for k in keys)):
        arg = ",".join(f"{k}={v}" for k, v in zip(keys, values))
        if refused(name, arg):
            with pytest.raises(ValueError, match="heads=paper|pattern=strided"):
                load(name).get_config(arg)
            continue
        yield arg


def test_every_config_file_is_covered():
    files = {os.path.basename(p) for p in glob.glob(os.path.join(CONFIGS, "*.py"))}
    assert files - HELPERS == set(VARIANTS)
    assert configs.names() == sorted(name[:-3] for name in VARIANTS)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_loads_locked_and_builds_a_model_config(name):
    module = load(name)
    assert module.get_config().to_dict() == module.get_config("").to_dict()  # defaults
    for arg in [None, *variants(name)]:
        config = module.get_config(arg)
        if tuple(config.model.image_shape) == ():  # images.py: the shape of its pictures
            assert (config.model.seq_len, config.model.stride, config.model.c) == (0, 0, 0)
            config.model.update(dict(image_shape=(32, 32, 3), seq_len=3072, stride=96, c=24))
        cfg = model_config(config.model)
        assert isinstance(cfg, ModelConfig)
        with pytest.raises(AttributeError):
            config.optimizer.learning_rate = 1.0  # a typo cannot add a field
        with pytest.raises(TypeError):
            config.total_steps = "many"
        if config.data.name in ("bytes", "images"):  # a file or a folder to read
            path, config.data.path = config.data.path, None
            with pytest.raises(ValueError, match="data.path"):
                check_config(config)
            config.data.path = path or "pictures"  # images: no default folder
        assert check_config(config) == cfg
        assert config.eval_every > 0 and config.checkpoint_every > 0
        if arg and "size=tiny" in arg:  # a smoke test: tiny model, few steps
            assert config.total_steps <= 20 and config.model.num_layers <= 2
            assert config.model.d_model <= 64


def test_paper_settings():
    enwik8 = load("enwik8.py").get_config()
    m = enwik8.model
    assert (m.seq_len, m.num_layers, m.d_model, m.num_heads, m.dropout) == (12288, 30, 512, 8, 0.4)
    assert (m.pattern, m.stride, m.c, m.mode) == ("fixed", 128, 32, "merged")
    cifar = load("cifar10.py").get_config()
    m = cifar.model
    assert (m.seq_len, m.num_layers, m.d_model, m.num_heads, m.dropout) == (3072, 128, 256, 2, 0.25)
    assert (m.pattern, m.stride, m.ff_mult, m.qk_ratio) == ("strided", 96, 2.0, 0.5)
    assert cifar.optimizer.lr == 3.5e-4 and cifar.optimizer.warmup_steps == 5000
    for config in (enwik8, cifar):
        assert config.optimizer.grad_clip == 1.0 and config.optimizer.weight_decay == 0.01


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_docstring_states_command_hardware_time_and_target(name):
    doc = load(name).__doc__
    assert f"python scripts/train.py --config=configs/{name}" in doc
    for word in ("Hardware", "ime", "arget"):  # Wall time / wall time, Target / target
        assert word in doc, word


def test_every_field_has_a_comment():
    for name in [*HELPERS, *VARIANTS]:
        with open(os.path.join(CONFIGS, name)) as f:
            source = f.read()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
                line = lines[node.lineno - 1]
                assert "#" in line or "#" in lines[node.lineno - 2], f"{name}:{node.lineno}"


@pytest.mark.parametrize("arg,message", [
    ("size=huge", "not one of"),
    ("sise=tiny", "unknown config argument"),
    ("tiny", "not key=value"),
    ("pattern=local", "not one of"),
    ("size=million,pattern =fixed", "holds a space"),  # was read as pattern=strided's default
    ("size=million, pattern=strided", "holds a space"),
    ("size=tiny,,pattern=fixed", "empty item"),
    ("size=tiny,", "empty item"),
    (",size=tiny", "empty item"),
    ("size=tiny,size=tiny", "given twice"),
])
def test_bad_config_arguments_fail(arg, message):
    with pytest.raises(ValueError, match=message):
        load("enwik8.py").get_config(arg)


@pytest.mark.parametrize("name", configs.names())
def test_every_config_file_parses_its_argument_strictly(name):
    """Every config file's argument goes through the one strict parser (common.parse_args): a
    space or an empty item is refused by each, not dropped."""
    for arg in ("bogus =1", "bogus=1,", " "):
        with pytest.raises(ValueError, match="space|empty item"):
            configs.load(f"{name}:{arg}")


def test_a_key_given_is_told_from_its_default():
    """enwik8's size=million trains strided unless pattern is given: given, fixed is refused
    (a space once hid the key from it: 20 strided layers were described)."""
    assert load("enwik8.py").get_config("size=million").model.pattern == "strided"
    with pytest.raises(ValueError, match="size=million trains pattern=strided"):
        load("enwik8.py").get_config("size=million,pattern=fixed")


def parse(*argv, values=None):
    values = flags.FlagValues() if values is None else values
    argv = ["train.py", *argv]
    config_flags.DEFINE_config_file("config", None, "config", flag_values=values, lock_config=True,
                                    sys_argv=argv)  # as scripts/train.py, without sys.argv
    values(argv)
    return values.config


def test_loader_reads_names_paths_and_outside_files_as_the_command_line_does(tmp_path):
    path = os.path.join(CONFIGS, "quickstart.py")
    expected = parse(f"--config={path}:data=embedded", "--config.optimizer.lr=0.01").to_dict()
    for spec in ["quickstart:data=embedded", "quickstart.py:data=embedded",
                 f"{path}:data=embedded"]:
        assert configs.load(spec, {"optimizer.lr": 0.01}).to_dict() == expected, spec
    mine = tmp_path / "my_config.py"  # a user's config outside the package, built on common
    mine.write_text("from configs import common\n\n\ndef get_config(arg=None):\n"
                    "    c = common.base()\n    c.total_steps = 7\n    return common.finish(c)\n")
    assert configs.load(str(mine)).total_steps == parse(f"--config={mine}").total_steps == 7
    with pytest.raises(ValueError, match="nope.py not found"):
        configs.load("configs/nope.py")
    with pytest.raises(ValueError, match="no field 'optimizer.lrr'"):
        configs.load("quickstart", {"optimizer.lrr": 0.01})


def test_command_line_overrides_reject_typos_and_wrong_types():
    path = os.path.join(CONFIGS, "enwik8.py")
    config = parse(f"--config={path}:size=tiny", "--config.optimizer.lr=0.01",
                   "--config.model.pattern=strided", "--config.data.split_fractions=(0.8,0.1,0.1)")
    assert config.optimizer.lr == 0.01 and config.model.pattern == "strided"
    assert config.model.num_layers == 2 and tuple(config.data.split_fractions) == (0.8, 0.1, 0.1)
    with pytest.raises((flags.Error, AttributeError), match="lrr"):  # with a "did you mean"
        parse(f"--config={path}:size=tiny", "--config.optimizer.lrr=0.01")
    with pytest.raises(flags.Error, match="many"):
        parse(f"--config={path}:size=tiny", "--config.total_steps=many")
    with pytest.raises(flags.Error, match="huge"):
        parse(f"--config={path}:size=huge")


def test_the_attention_implementation_may_change_on_resume(tmp_path):
    """The kernel and the XLA path compute the same numbers: a run trained on a GPU with the
    kernel resumes on a CPU with XLA; the pattern may not change."""
    from sparse_jax.run.config import resume_changes

    saved = configs.load("quickstart:data=embedded", {"model.attention": "pallas"})
    assert resume_changes(saved, configs.load("quickstart:data=embedded"), str(tmp_path)) == {
        "model.attention": ("pallas", "xla")}
    with pytest.raises(ValueError, match="model.pattern"):
        resume_changes(saved, configs.load("quickstart:data=embedded,pattern=fixed"),
                       str(tmp_path))


def test_a_shortened_run_warms_up_for_the_presets_share_unless_the_user_sets_warmup():
    """configs/images.py:size=cpu (2,400 steps, warmup 100) with --config.total_steps=100: the
    warmup becomes 4 (the same 4.2% of the run), one line says from what to what and how to set
    it, and the config passes the trainer's check; a warmup given on the command line is kept
    (and checked); a resumed run keeps the warmup it trained with."""
    path = os.path.join(CONFIGS, "images.py")
    values = flags.FlagValues()
    config = parse(f"--config={path}:size=cpu", "--config.total_steps=100", values=values)
    preset = cli.preset_total_steps(values)
    assert preset == 2400 and config.optimizer.warmup_steps == 100
    line = follow_total_steps(config, preset)
    assert config.optimizer.warmup_steps == 4 and "\n" not in line
    assert "warmup_steps=4 instead of the preset's 100" in line and "total_steps=100" in line
    assert "--config.optimizer.warmup_steps" in line
    config.model.update(image_shape=(32, 32, 3), seq_len=3072, stride=96, c=24)
    config.data.path = "pictures"
    check_config(config)
    values = flags.FlagValues()  # the user's warmup: kept, and the check says what to do
    config = parse(f"--config={path}:size=cpu", "--config.total_steps=100",
                   "--config.optimizer.warmup_steps=100", values=values)
    assert cli.preset_total_steps(values) is None and follow_total_steps(config, None) is None
    config.model.update(image_shape=(32, 32, 3), seq_len=3072, stride=96, c=24)
    config.data.path = "pictures"
    with pytest.raises(ValueError, match=r"warmup_steps=100 must be in \[0, total_steps=100\): "
                                         r"set --config.optimizer.warmup_steps"):
        check_config(config)
    values = flags.FlagValues()  # lengthened: nothing to say
    config = parse(f"--config={path}:size=cpu", "--config.total_steps=3000", values=values)
    assert follow_total_steps(config, cli.preset_total_steps(values)) is None
    assert config.optimizer.warmup_steps == 100
    config = parse(f"--config={path}:size=cpu", "--config.total_steps=200")
    recorded = parse(f"--config={path}:size=cpu", "--config.optimizer.warmup_steps=4")
    line = follow_total_steps(config, 2400, recorded)  # resumed: the recorded warmup, not 8
    assert config.optimizer.warmup_steps == 4 and "resumed" in line
    assert [scaled_warmup(100, 2400, n) for n in (1, 2, 10, 100, 1200, 2400)] == [
        0, 1, 1, 4, 50, 100]
    assert scaled_warmup(0, 2400, 100) == 0
