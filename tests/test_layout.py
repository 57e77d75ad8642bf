"""The library's layout (docs/layout.md): packages by concern, imports that only run down, no
cycle, and modules a reader can hold."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "sparse_jax"
# Lowest first: a module imports only from its own part or the parts before it.
LAYERS = [
    ("files", "flag_checks", "cli", "stopping", "logs", "sharding"),  # files, flag checks, the
    # error path and stops, console, logs, meshes
    ("attention",),  # patterns to kernels
    ("model",),  # the Flax model
    ("data",),  # sources, datasets, batches
    ("run",),  # what a run reads and writes: config, setup, checkpoints, workdir, logs
    ("evaluate",),
    ("attention_stats",),  # where a trained model looks (beside evaluate: reads a checkpoint)
    ("train",),
    ("sample",),
    ("bench",),  # benchmarks and studies, apart from the library
]
LONGEST = 500  # lines; a module may be longer only if its docstring says why it is one piece


def _part(module: str) -> str:
    return module.split(".")[1]


def _layer(module: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if _part(module) in names)


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: pathlib.Path, modules) -> set[str]:
    """The sparse_jax modules `path` imports, at any depth (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparse_jax"):
            for alias in node.names:  # `from pkg import module` names a module
                name = f"{node.module}.{alias.name}"
                found.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("sparse_jax."))
    return found - {"sparse_jax"}


def test_every_part_has_a_layer():
    assert {_part(m) for m in _modules() if m != "sparse_jax"} == {n for x in LAYERS for n in x}


def test_imports_run_down_and_never_in_a_cycle():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items() if m != "sparse_jax"}
    upward = [f"{m} imports {i}" for m, deps in graph.items() for i in deps
              if _layer(i) > _layer(m)]
    assert not upward, upward
    # A package's __init__ re-exports its modules: an edge into a package is one into __init__.
    state = {}

    def visit(m, path):
        state[m] = "open"
        for i in sorted(graph.get(m, ())):
            if state.get(i) == "open":
                pytest.fail("import cycle: " + " -> ".join(path[path.index(i):] + [i]))
            if i not in state:
                visit(i, path + [i])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_modules_fit_in_a_readers_head():
    long = [f"{p.relative_to(ROOT.parent)}: {n} lines" for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > LONGEST
            and "one piece" not in (ast.get_docstring(ast.parse(p.read_text())) or "")]
    assert not long, long
