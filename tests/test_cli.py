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
