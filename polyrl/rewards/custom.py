"""Load a user's reward function from a Python file, as verl's `custom_reward_function.{path,name}` does."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable

from polyrl.errors import RewardError


def load_module(path: str, what: str, key: str):
    """The Python file at `path` as a module (`key`.path names it in errors; `what` is what the file must define)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise RewardError(f"{key}.path '{path}' does not exist; point it at the .py file defining {what}.")
    # A name unique to the resolved path: two reward files both called reward.py must not shadow each other.
    mod_name = f"polyrl_custom_reward_{hashlib.md5(str(p.resolve()).encode()).hexdigest()[:10]}"
    spec = importlib.util.spec_from_file_location(mod_name, p)
    if spec is None or spec.loader is None:
        raise RewardError(f"{key}.path '{path}' cannot be imported as Python; give it a .py file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # lets the file use dataclasses/pickle, which look their module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise RewardError(
            f"Importing custom reward file '{path}' raised {type(e).__name__}: {e}; fix the file."
        ) from e
    return module


def load_custom_reward(path: str, name: str = "compute_score", key: str = "custom_reward_function") -> Callable:
    """`name` from the Python file at `path`; `key` is the config section the errors name (both trainers use this)."""
    module = load_module(path, f"'{name}'", key)
    mod_name = module.__name__
    fn = getattr(module, name, None)
    if not callable(fn):
        present = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == mod_name)
        what = "is not callable" if fn is not None else "is not defined"
        raise RewardError(
            f"Function '{name}' {what} in custom reward file '{path}' (its functions: {', '.join(present) or 'none'}); "
            f"set {key}.name to one of them."
        )
    return fn
