"""The entry points' shared pieces (`sparse_jax.cli`): the restart under huge pages."""

import os
import subprocess
import sys

from sparse_jax import cli


def test_huge_pages_env_adds_the_tunable_once_and_keeps_others(monkeypatch):
    monkeypatch.setattr(cli, "_huge_pages_supported", lambda env: True)
    env = cli.huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "A": "1"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "A": "1"}
    assert cli.huge_pages_env(env) == env  # already set: unchanged
    assert cli.huge_pages_env({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"


def test_huge_pages_can_be_turned_off():
    assert cli.huge_pages_env({cli.HUGE_PAGES_ENV: "0"}) == {cli.HUGE_PAGES_ENV: "0"}


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
