"""The documentation: every `python scripts/X.py` command written in the README and the pages
names a script that exists and only flags and config fields that it accepts (nothing is run),
the README stays a short front door, and the site builds with warnings as errors, tutorial
executed (`sphinx-build -W`, needs the docs extra)."""

import dataclasses
import functools
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

import configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = re.compile(r"python3? (scripts/[\w]+\.py)((?:[ \t]+[^\s`|]+)*)")


def documents() -> list[str]:
    """The README and the site's pages (not the result tables the pages read)."""
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs",
                                                                             "*.md")))]


def commands(text: str) -> list[tuple[str, list[str]]]:
    """(script, arguments) of every `python scripts/X.py ...` in `text`, with shell line
    continuations joined and quotes and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", text)
    found = []
    for match in COMMAND.finditer(text):
        args = match.group(2).split("#", 1)[0].split()
        found.append((match.group(1), [a.strip("'\"") for a in args]))
    return found


@functools.lru_cache(maxsize=None)
def script_flags(script: str) -> frozenset[str]:
    """The flags `script` defines (its own, absl's, --config), read from its --helpfull."""
    out = subprocess.run([sys.executable, script, "--helpfull"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120).stdout
    names = set()
    for match in re.finditer(r"^\s+--(\[no\])?([\w.-]+)", out, re.MULTILINE):
        names.add(match.group(2))
        if match.group(1):
            names.add("no" + match.group(2))
    return frozenset(names)


def has_field(config, dotted: str) -> bool:
    node = config
    for part in dotted.split("."):
        if not hasattr(node, "keys") or part not in node.keys():
            return False
        node = node[part]
    return True


def problems(text: str, where: str = "text") -> list[str]:
    """What is wrong with the commands in `text`: missing scripts, unknown flags, config
    fields the named config does not have."""
    found = []
    for script, args in commands(text):
        if not os.path.isfile(os.path.join(ROOT, script)):
            found.append(f"{where}: {script} does not exist")
            continue
        flags = script_flags(script)
        spec = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
        for arg in args:
            if not arg.startswith("--"):
                continue
            name = arg[2:].split("=", 1)[0]
            if name.startswith("config.") and "config" in flags:
                if spec is None or "<" in spec or "$" in spec:
                    continue  # a field of a config the text leaves open
                config = configs.load(spec.replace("{root}/", ""))
                if not has_field(config, name[len("config."):]):
                    found.append(f"{where}: {script} --config={spec} has no field "
                                 f"{name[len('config.'):]!r}")
            elif name not in flags:
                found.append(f"{where}: {script} has no flag --{name}")
    return found


@pytest.mark.slow
def test_every_documented_command_names_real_scripts_flags_and_fields():
    found, count = [], 0
    for path in documents():
        with open(path) as f:
            text = f.read()
        count += len(commands(text))
        found += problems(text, os.path.relpath(path, ROOT))
    assert count > 50  # the pages hold the commands
    assert not found, "\n".join(found)


@pytest.mark.slow
def test_a_renamed_flag_or_field_is_caught():
    text = """Train:
    python scripts/train.py --config=configs/quickstart.py --workdir=w \\
        --made_up_flag=3 --config.model.made_up_field=2
    and `python scripts/no_such_script.py --x=1`."""
    assert commands(text)[0][1][-2:] == ["--made_up_flag=3", "--config.model.made_up_field=2"]
    assert problems(text) == [
        "text: scripts/train.py has no flag --made_up_flag",
        "text: scripts/train.py --config=configs/quickstart.py has no field "
        "'model.made_up_field'",
        "text: scripts/no_such_script.py does not exist"]


def test_the_readme_is_a_short_front_door():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert readme.count("\n") <= 250
    for page in re.findall(r"\]\((docs/[\w/.-]+\.md)\)", readme):  # every page it lists exists
        assert os.path.isfile(os.path.join(ROOT, page)), page


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    """The README's command: every page, the API reference (a missing or broken reference is
    a warning, so an error here) and the tutorial, executed."""
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_nb")
    out = tmp_path / "html"
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
                           "html", "docs", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)  # a hang's limit: ~3 min idle, longer on a loaded host
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Kernel is running over TCP" not in proc.stderr  # the tutorial's kernel is encrypted
    tutorial = (out / "tutorial.html").read_text()
    assert "bits per byte" in tutorial and "max difference from the dense reference" in tutorial
    api = (out / "api.html").read_text()
    assert api.count('class="sig-name descname"') >= 20
    text = re.sub(r"<[^>]+>", "", api)
    for module in ("SparseSelfAttention(d_model, num_heads", "Block(d_model, num_heads",
                   "SparseTransformer(cfg"):  # NNX modules with their own parameters
        assert module in text, module
    assert "(*args, **kwargs)" not in text
    from sparse_jax.model.config import ModelConfig

    for field in dataclasses.fields(ModelConfig):  # each with its own line of text
        anchor = f"sparse_jax.model.ModelConfig.{field.name}"
        entry = re.search(rf'id="{anchor}".*?</dd>', api, re.S)
        assert entry and re.search(r"<dd><p>\S", entry.group(0)), field.name
    shutil.rmtree(tmp_path / "html", ignore_errors=True)
