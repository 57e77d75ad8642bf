"""The install without TensorFlow: TensorFlow Datasets is the optional `tfds` extra, so no module
imports TensorFlow, and CIFAR-10 without it is a one-line error that says what to install (tested
by hiding the installed package: `sys.modules[name] = None` makes its import fail). Importing a
module installs no process-wide hook (`checkpoints.install_hooks` runs with the first manager)."""

import os
import subprocess
import sys

import pytest

from conftest import one_line_error
from sparse_jax import cli
from sparse_jax.data import datasets as D
from sparse_jax.data.cifar10 import cifar10_source
from test_train import ROOT


def test_without_tfds_cifar10_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # as if not installed
    config = {"name": "cifar10", "data_dir": str(tmp_path)}
    for fn in (lambda: D.prepare(config), lambda: cifar10_source("test", str(tmp_path)),
               lambda: D.fingerprint(config)):
        one_line_error(ModuleNotFoundError, fn, "pip install 'sparse_jax[tfds]'",
                       "tensorflow-datasets", "configs/images.py")
    assert ModuleNotFoundError in cli.USER_ERRORS  # the scripts print it as one error line


@pytest.mark.slow
def test_no_module_imports_tensorflow_and_the_scripts_say_what_to_install(tmp_path):
    code = ("import importlib, pkgutil, sys\nimport configs, sparse_jax\nskipped = []\n"
            "for m in pkgutil.iter_modules(sparse_jax.__path__):\n"
            "    try:\n        importlib.import_module('sparse_jax.' + m.name)\n"
            "    except ModuleNotFoundError as e:  # torch: the bench extra\n"
            "        assert e.name == 'torch', e\n        skipped.append(m.name)\n"
            "for name in configs.names():\n    importlib.import_module('configs.' + name)\n"
            "loaded = sorted(k for k in sys.modules if k.split('.')[0] in "
            "('tensorflow', 'tensorflow_datasets'))\nassert not loaded, loaded[:5]\n"
            "assert sys.excepthook is sys.__excepthook__, 'a hook installed at import'\n"
            "assert sys.unraisablehook is sys.__unraisablehook__, 'a hook installed at import'\n"
            "print('ok', skipped)\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr
    block = ("import runpy, sys\nsys.modules['tensorflow_datasets'] = None\n"
             f"sys.argv = ['train.py', '--config={ROOT}/configs/cifar10.py:size=tiny', "
             f"'--workdir={tmp_path}/run', '--config.data.data_dir={tmp_path}/tfds']\n"
             f"runpy.run_path('{ROOT}/scripts/train.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, env=env,
                          timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "pip install 'sparse_jax[tfds]'" in lines[0]
