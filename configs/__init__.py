"""The training configs, one module per task, and the one loader of config specs.

A config module defines `get_config(arg)` returning a locked `ml_collections.ConfigDict`; `arg`
is a comma-separated list of `key=value` variant choices (see `common.parse_args`). A config
*spec* names a module and, after a colon, its argument:

  quickstart                       this package's configs/quickstart.py, default variant
  quickstart.py:pattern=dense      the same with an argument
  configs/bytes.py:size=cpu        a path, as `scripts/train.py --config=` takes it
  /home/me/my_config.py:size=big   any file that defines get_config (it may
                                   `from configs import common`)

`load(spec, overrides)` is what the library, the tests, the pattern study and the benchmarks
use; the scripts take the same files through ml_collections' `--config` flag, which adds
`--config.FIELD=value` overrides on the command line.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Mapping
from typing import Any

import ml_collections

FOLDER = os.path.dirname(os.path.abspath(__file__))
NOT_CONFIGS = ("__init__", "common")  # modules here that are not configs


def names() -> list[str]:
    """The configs of this package: ["bytes", "cifar10", ...]."""
    return sorted(name[:-3] for name in os.listdir(FOLDER)
                  if name.endswith(".py") and name[:-3] not in NOT_CONFIGS)


def split_spec(spec: str) -> tuple[str, str | None]:
    """`"configs/bytes.py:size=cpu"` -> (path of the file, "size=cpu"); ValueError if the file is
    missing. A bare name (`bytes`, `bytes.py`) is looked up in this package."""
    where, _, arg = spec.partition(":")
    if os.path.sep not in where and "/" not in where:
        name = where[:-3] if where.endswith(".py") else where
        if name in names():
            return os.path.join(FOLDER, f"{name}.py"), arg or None
    if not os.path.isfile(where):
        raise ValueError(f"config file {where} not found; give a path to a config file or one "
                         f"of {names()}")
    return where, arg or None


def module(path: str):
    """The config module at `path`: this package's own by import, any other file by path."""
    if os.path.dirname(os.path.abspath(path)) == FOLDER:
        return importlib.import_module(f"configs.{os.path.basename(path)[:-3]}")
    name = "config_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(loaded)
    return loaded


def load(spec: str, overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
    """The config `spec` names (see the module docstring), then `overrides` given as flat dotted
    names ({"optimizer.lr": 1e-3}); a field that does not exist is a ValueError, as a mistyped
    `--config.FIELD` is on the command line."""
    path, arg = split_spec(spec)
    config = module(path).get_config(arg)
    for name, value in (overrides or {}).items():
        try:
            config.update_from_flattened_dict({name: value})
        except (KeyError, AttributeError) as e:
            raise ValueError(f"{spec} has no field {name!r} to override; fields of its sections "
                             f"are listed in configs/common.py") from e
    return config
