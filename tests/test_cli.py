"""The entry points' shared pieces (`sparse_jax.cli`): the restart under huge pages."""

import os
import subprocess
import sys

import pytest

from sparse_jax import cli


def test_huge_pages_env_adds_the_tunable_once_and_keeps_others(monkeypatch):
    monkeypatch.setattr(cli, "_huge_pages_supported", lambda env: True)
    env = cli.huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "A": "1"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "A": "1"}
    assert cli.huge_pages_env(env) == env  # already set: unchanged
    assert cli.huge_pages_env({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"


def test_huge_pages_can_be_turned_off():
    assert cli.huge_pages_env({cli.HUGE_PAGES_ENV: "0"}) == {cli.HUGE_PAGES_ENV: "0"}


def test_switches_take_1_or_0_and_refuse_anything_else():
    """SPARSE_JAX_HUGE_PAGES=no used to leave huge pages on (only "0" turned them off), and
    SPARSE_JAX_TRACEBACK=no turned tracebacks on."""
    for name in cli.SWITCHES:
        assert cli.env_switch(name, True, {}) is True and cli.env_switch(name, False, {}) is False
        assert cli.env_switch(name, True, {name: "0"}) is False
        assert cli.env_switch(name, False, {name: " 1"}) is True
        for value in ("no", "false", "yes", "2", "off"):
            with pytest.raises(ValueError, match=f"\\${name}='{value}' must be 1 or 0"):
                cli.check_environment({name: value})


def test_a_malformed_switch_is_one_line_before_anything_runs(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("from sparse_jax import cli\n"
                      "cli.run(lambda argv: print('ran'), huge_pages=True)\n")
    env = {**os.environ, cli.HUGE_PAGES_ENV: "no"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"error: ${cli.HUGE_PAGES_ENV}='no' must be 1 or 0 (or unset); set it to one of them"]


def test_a_script_restarts_once_with_its_arguments(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import os\n"
        "from sparse_jax import cli\n"
        "def main(argv):\n"
        "    print('tunables=' + os.environ.get('GLIBC_TUNABLES', ''), *argv[1:])\n"
        "cli.run(main, huge_pages=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, str(script), "a b", "c"], env=env, check=True,
                         capture_output=True, text=True).stdout
    expected = cli.huge_pages_env(env).get("GLIBC_TUNABLES", "")  # "" where not supported
    assert out.splitlines() == [f"tunables={expected} a b c"]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # starts the scripts
@pytest.mark.parametrize("script", ["train", "evaluate"])
def test_help_lists_the_multi_host_flags_the_docstring_names(script):
    """`--help` lists a script's own flags; the multi-host flags, defined in sparse_jax.sharding
    for the scripts that take them, are the script's own (not only in --helpfull)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", f"{script}.py"),
                          "--help"], capture_output=True, text=True, timeout=120).stdout
    for name in ("cpu_devices", "jax_distributed", "coordinator_address", "num_processes",
                 "process_id"):
        assert f"--{name}" in out or f"--[no]{name}" in out, name


def test_flag_values_no_script_takes_are_refused_when_parsed():
    """`check_flag_values`: a float that is not finite, an integer past the int32 limit where
    the flag has no bound of its own, a list given empty, with an empty item or an item twice
    (unless `list_rules` allows it); a flag left at its default is not checked."""
    from absl import flags

    values = flags.FlagValues()
    flags.DEFINE_float("rate", 1.0, "", flag_values=values)
    flags.DEFINE_integer("count", 1, "", flag_values=values)
    flags.DEFINE_integer("bounded", 1, "", upper_bound=10**13, flag_values=values)
    flags.DEFINE_list("items", ["a"], "", flag_values=values)
    flags.DEFINE_list("maybe", ["a"], "", flag_values=values)
    cli.list_rules("maybe", empty="none", repeats="equal shares")
    bad = {"--rate=nan": "not a finite number", "--rate=inf": "not a finite number",
           "--count=3000000000": "above the limit 2,147,483,647",
           "--items=": "an empty list", "--items=a,,b": "an empty item",
           "--items=a,a": "a given twice"}
    for arg, why in bad.items():
        values.unparse_flags()
        values(["script", arg])
        with pytest.raises(ValueError, match=why) as e:
            cli.check_flag_values(values)
        assert f"--{arg[2:].split('=')[0]}" in str(e.value)
    for arg in ("--rate=2.5", "--count=-3", "--bounded=3000000000", "--maybe=", "--maybe=a,a",
                "--items=a,b"):
        values.unparse_flags()
        values(["script", arg])
        cli.check_flag_values(values)


def test_a_path_flag_is_checked_without_writing(tmp_path):
    """The path checks name the flag and write nothing, not even a missing folder."""
    from absl import app

    (tmp_path / "file").write_text("x")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "results.md").write_text("x")
    cases = [(cli.input_file, ("data", str(tmp_path / "absent")), "does not exist"),
             (cli.input_file, ("data", str(tmp_path)), "is a folder"),
             (cli.input_dir, ("path", str(tmp_path / "file")), "is a file"),
             (cli.output_file, ("output", str(tmp_path)), "is a folder"),
             (cli.output_file, ("output", str(tmp_path / "file")), "exists"),  # unasked
             # a file written beside the output (cost_model.py's results.md): an unrelated one
             # there is not replaced, and a folder there is refused before the work, not after
             (cli.output_file, ("output", str(tmp_path / "done" / "cm.json"), False,
                                ("results.md",)), "results.md exists; pass --overwrite"),
             (cli.output_file, ("output", str(tmp_path / "cm.json"), True, ("done",)),
              "done is a folder"),
             (cli.output_dir, ("output_dir", str(tmp_path / "file")), "is a file"),
             (cli.output_dir, ("output_dir", str(tmp_path / "done"), ("results.md",)),
              "already holds results.md"),
             (cli.output_dir, ("output_dir", ""), "is empty")]
    for check, args, why in cases:
        with pytest.raises(app.UsageError, match=why) as e:
            check(*args)
        assert str(e.value).startswith(f"--{args[0]}")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    cli.output_dir("output_dir", str(tmp_path / "new" / "deeper"), ("results.md",))
    cli.output_file("output", str(tmp_path / "new" / "out.json"))
    cli.output_file("output", str(tmp_path / "file"), True)  # --overwrite
    cli.output_file("output", str(tmp_path / "done" / "cm.json"), True, ("results.md",))
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
