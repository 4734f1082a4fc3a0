"""Loading users' code, one way for every kind of it: reward functions (and main_eval's scorer), dataset classes,
tools, interactions (users' agent loops, issue 27, will load here too). A location is a Python file's path (run
once per process, under a module name derived from the path, so the file can import its siblings through it) or a
dotted module path; the object is an attribute of it, named apart or as the dotted path's last part. Errors name
the config key and what was looked for.

    load_object("my_reward.py", "reward.custom_reward_function.path", name="compute_score",
                name_key="reward.custom_reward_function.name")
    load_object("pyrl.tools.calculator.CalculatorTool", "class_name")
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

_LOADED_FILES: dict[str, ModuleType] = {}


def is_file_location(location: str) -> bool:
    """A path (ends in .py or has a separator) rather than a dotted module name."""
    return location.endswith(".py") or os.sep in location or "/" in location


def load_file(path: str, key: str) -> ModuleType:
    """The module the Python file at `path` defines, run once per process (a second load returns the same module),
    pickled by value (its name means nothing to another process)."""
    abs_path = os.path.abspath(path)
    if not os.path.isfile(abs_path):
        raise FileNotFoundError(f"{key}: {path!r} does not exist")
    if abs_path in _LOADED_FILES:
        return _LOADED_FILES[abs_path]
    module_name = "pyrl_user_" + abs_path.replace(os.sep, "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(module_name, abs_path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{key}: cannot import {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and typing look a class's module up while it is being made
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    # other processes (the reward scoring pool, Ray workers) cannot import it by that name: its functions and
    # classes travel by value
    import ray.cloudpickle  # lazy: ray loads only when users' code does

    ray.cloudpickle.register_pickle_by_value(module)
    _LOADED_FILES[abs_path] = module
    return module


PKG_PREFIX, FILE_PREFIX = "pkg://", "file://"  # verl 0.9.1's load_module prefixes


def load_module(location: str, key: str) -> ModuleType:
    """A file's module (load_file) or an importable module by dotted name; verl's spellings too: pkg://a.b or
    pkg://a/b (a module), file://path (a file)."""
    if location.startswith(PKG_PREFIX):
        location = location[len(PKG_PREFIX):].replace("/", ".")
    elif location.startswith(FILE_PREFIX):
        return load_file(location[len(FILE_PREFIX):], key)
    if is_file_location(location):
        return load_file(location, key)
    try:
        return importlib.import_module(location)
    except ModuleNotFoundError as e:
        raise ImportError(f"{key}: cannot import module {location!r}: {e}") from None


def load_object(location: str, key: str, name: str | None = None, name_key: str | None = None,
                what: str = "") -> Any:
    """The object `name` of the module at `location` (load_module), or, without `name`, the object a dotted path
    `package.module.Object` names. `what` ("function", "class") words the error for a missing name."""
    if name is None:
        module_path, _, name = location.rpartition(".")
        if not module_path or is_file_location(location):
            raise ValueError(f"{key}: expected a dotted path module.Name, got {location!r}")
        module = load_module(module_path, key)
        if not hasattr(module, name):
            raise ImportError(f"{key} {location!r}: module {module_path} has no {name}")
        return getattr(module, name)
    module = load_module(location, key)
    if not hasattr(module, name):
        raise AttributeError(f"{name_key or key}: {location!r} defines no {what + ' ' if what else ''}{name!r}")
    return getattr(module, name)
