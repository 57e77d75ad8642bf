"""The "In your own model" code block of docs/attention.md (the page the README sends users to
for the attention API) runs as printed, gives the shapes and dtypes its comments state, and its
attention equals the dense masked reference; and the README's facts a newcomer reads first: the
licence it names is in the repository, a results row is a figure and its command (the story is
on the linked page), the quickstart gives its spread across hosts, and "Your own data" says how
long a useful run is and how to shorten one."""

import os
import re
import tomllib

import jax.numpy as jnp
import numpy as np

from sparse_jax.attention import dense_attention

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                      "attention.md")
SECTION = "## In your own model"


def readme_block() -> str:
    """The first ```python block of the section."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert SECTION in text, f"docs/attention.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the section has no ```python block"
    return match.group(1)


def test_attention_example_runs_as_printed():
    code = readme_block()
    # What the comments state, so that the block and this test cannot drift apart.
    assert "# [2, 1024, 4, 32] bf16" in code and "# [2, 1024, 128] float32" in code
    namespace = {"__name__": "readme_example"}
    exec(compile(code, README, "exec"), namespace)
    out, y = namespace["out"], namespace["y"]
    assert out.shape == (2, 1024, 4, 32) and out.dtype == jnp.bfloat16
    assert y.shape == (2, 1024, 128) and y.dtype == jnp.float32

    q, k, v = (namespace[name].astype(jnp.float32) for name in "qkv")
    reference = dense_attention(q, k, v, namespace["spec"].mask(q.shape[1]))
    np.testing.assert_allclose(np.asarray(out, np.float32), reference, atol=3e-2)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def front_door() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def section(text: str, title: str) -> str:
    assert f"\n## {title}\n" in text, f"README.md has no section {title!r}"
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_licence_the_readme_names_is_in_the_repository_and_the_wheel():
    """README and pyproject say Apache-2.0; LICENSE holds the licence's whole text, and
    setuptools' default license-files (LICEN[CS]E*, no key in pyproject) put it in the wheel."""
    assert "Apache-2.0" in front_door()
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["license"] == "Apache-2.0"
    assert "LICENSE" in project.get("license-files", ["LICENSE"])
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        text = f.read()
    for part in ["Apache License", "Version 2.0, January 2004", "TERMS AND CONDITIONS FOR USE, "
                 "REPRODUCTION, AND DISTRIBUTION", "9. Accepting Warranty or Additional "
                 "Liability.", "END OF TERMS AND CONDITIONS", "APPENDIX: How to apply"]:
        assert part in text, part
    assert len(text.split()) > 1500  # the whole text, not a pointer to it


def test_a_results_row_is_a_figure_and_its_command():
    """One line each: what and where, the command, the figure (and a comparison); the story
    behind a figure lives on the page the row links to."""
    rows = [line for line in section(front_door(), "Results").splitlines()
            if line.startswith("| ") and not line.startswith("| what")]
    assert len(rows) >= 8
    for row in rows:
        what, command, result = (cell.strip() for cell in row.strip("|").split(" | "))
        assert command.startswith("`python scripts/") or command == "same", row
        assert len(result) <= 140 and result.count(". ") == 0, result


def test_the_quickstart_figure_gives_its_spread_and_your_own_data_how_long_a_run_is():
    text = front_door()
    quickstart = section(text, "Quickstart")
    assert "**1.94–1.95 bits/byte**" in quickstart and "1.9397" in quickstart \
        and "1.9502" in quickstart and "add floats in other orders" in quickstart
    own = section(text, "Your own data")
    assert "2,900 steps" in own and "--config.total_steps=600" in own
    assert "not a broken one" in own


def _wall_time(results: str, run: str) -> str:
    """The wall time of `run` ("configs/quickstart.py") in docs/results.md's table."""
    row = next(line for line in results.splitlines() if line.startswith(f"| `{run}` |"))
    return row.strip("|").split(" | ")[3].strip()


def _docstring(path: str) -> str:
    import ast

    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read()))


def test_the_front_doors_figures_come_from_one_source():
    """A preset's wall time is measured once (docs/results.md's table) and the README, the
    getting-started page and the preset's docstring quote that figure and no other; the test
    suite's count and time are the README's, which the getting-started page quotes."""
    with open(os.path.join(ROOT, "docs", "results.md"), encoding="utf-8") as f:
        results = f.read()
    with open(os.path.join(ROOT, "docs", "getting_started.md"), encoding="utf-8") as f:
        started = f.read()
    readme, times = front_door(), re.compile(r"\d+ min \d+ s")
    quick = _wall_time(results, "configs/quickstart.py")
    cpu = _wall_time(results, "configs/bytes.py:size=cpu")
    assert times.fullmatch(quick) and times.fullmatch(cpu)
    rows = {line.split(" | ")[1]: line for line in section(readme, "Results").splitlines()
            if line.startswith("| ")}
    command = "`python scripts/train.py --config=configs/{} --workdir=W`"
    assert quick in section(readme, "Quickstart") and quick in rows[command.format("quickstart.py")]
    assert cpu in section(readme, "Your own data") and cpu in rows[command.format(
        "bytes.py:size=cpu")]
    assert quick in section(started, "Quickstart")
    docstring = _docstring("configs/quickstart.py")
    assert times.findall(docstring) == [quick], docstring
    size_cpu = _docstring("configs/bytes.py").split("\nsize=cpu:", 1)[1].split("\nsize=")[0]
    assert times.findall(size_cpu) == [cpu], size_cpu
    # The suite: every "N tests in T" / "N took T" of the page is the README's.
    suite = re.compile(r"(\d[\d,]*) (?:tests in|took) (\d+ min \d+ s)")
    assert suite.findall(section(readme, "Tests"))
    assert set(suite.findall(started)) <= set(suite.findall(section(readme, "Tests")))
