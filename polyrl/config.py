"""Typed config trees built from small dataclasses, with verl-style `a.b.c=value` overrides.

Each component declares its own dataclass next to the code it configures; trainers compose them into the
verl-shaped tree. This module only knows how to fill such a tree from a YAML file plus command-line overrides:

- `key=value` sets an existing key; `+key=value` is accepted too (verl/Hydra's "add" syntax). Keys that do not exist
  in the schema are refused with the closest valid key suggested, because a silently ignored key is a silent bug.
- Values are parsed as YAML scalars/lists (`trainer.logger='["console","file"]'`, `1e-6`, `null`, `True`), then
  checked against the field's annotated type.
- Fields typed `dict` accept any sub-keys (free-form blocks such as `override_config`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from polyrl.errors import ConfigError


def all_keys(cfg: Any, prefix: str = "") -> list[str]:
    """Every dotted leaf key of a dataclass tree."""
    keys = []
    for f in dataclasses.fields(cfg):
        val = getattr(cfg, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(val):
            keys.extend(all_keys(val, name + "."))
        else:
            keys.append(name)
    return keys


def _suggest(key: str, cfg: Any) -> str:
    keys = all_keys(cfg)
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not close:  # compare the last component alone: "actor.lr" -> "actor_rollout_ref.actor.optim.lr"
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
        close = by_leaf[:1] or difflib.get_close_matches(key, keys, n=1, cutoff=0.3)
    return f"; did you mean '{close[0]}'?" if close else ""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against annotation `tp` (a resolved type), converting where it is lossless (int -> float)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"Config key '{key}' got {value!r}, which is not a {_type_name(tp)}; fix its value.")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            choices = ", ".join(repr(a) for a in typing.get_args(tp))
            raise ConfigError(f"Config key '{key}' got {value!r}; choose one of {choices}.")
        return value
    if origin in (list, tuple):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and origin is list:
            value = [value]  # `trainer.logger=console` means ["console"]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"Config key '{key}' expects a list, got {value!r}; write it as '[a,b]'.")
        (arg,) = typing.get_args(tp)[:1] or (Any,)
        return origin(_coerce(key, v, arg) for v in value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"Config key '{key}' expects a mapping, got {value!r}; write it as '{{k: v}}'.")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"Config key '{key}' expects true or false, got {value!r}.")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"Config key '{key}' expects a number, got {value!r}.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"Config key '{key}' expects an integer, got {value!r}.")
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # experiment_name=7
        if isinstance(value, str):
            return value
        raise ConfigError(f"Config key '{key}' expects a string, got {value!r}.")
    return value


def _field_types(cfg: Any) -> dict[str, Any]:
    return typing.get_type_hints(type(cfg))


def set_key(cfg: Any, key: str, value: Any) -> None:
    """Set dotted `key` in the dataclass tree `cfg`, validating the key and the value's type."""
    node, parts = cfg, key.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, dict):  # free-form block: create what is missing
            if i == len(parts) - 1:
                node[part] = value
            else:
                node = node.setdefault(part, {})
            continue
        names = {f.name for f in dataclasses.fields(node)}
        if part not in names:
            raise ConfigError(f"Unknown config key '{key}'{_suggest(key, cfg)}")
        if i == len(parts) - 1:
            tp = _field_types(node)[part]
            current = getattr(node, part)
            if dataclasses.is_dataclass(current):
                if not isinstance(value, dict):
                    raise ConfigError(f"Config key '{key}' is a group; set its fields, e.g. '{key}.<field>=...'.")
                for k, v in value.items():
                    set_key(cfg, f"{key}.{k}", v)
            else:
                setattr(node, part, _coerce(key, value, tp))
        else:
            node = getattr(node, part)
            if node is None:
                raise ConfigError(f"Config key '{key}' cannot be set because '{'.'.join(parts[: i + 1])}' is null.")


def apply_dict(cfg: Any, data: dict, prefix: str = "") -> None:
    for k, v in data.items():
        key = f"{prefix}{k}"
        node = _get(cfg, key)
        if dataclasses.is_dataclass(node) and isinstance(v, dict):
            apply_dict(cfg, v, key + ".")
        else:
            set_key(cfg, key, v)


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        if isinstance(node, dict):
            node = node.get(part)
        elif dataclasses.is_dataclass(node) and part in {f.name for f in dataclasses.fields(node)}:
            node = getattr(node, part)
        else:
            raise ConfigError(f"Unknown config key '{key}'{_suggest(key, cfg)}")
    return node


def parse_value(text: str) -> Any:
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text
    if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string; verl users write it that way
        try:
            return float(value)
        except ValueError:
            pass
    return value


def parse_args(argv: list[str]) -> tuple[str | None, list[tuple[str, Any]]]:
    """Split argv into (--config path, [(key, value), ...])."""
    config_path, overrides, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config", "-c", "--config-path"):
            if i + 1 >= len(argv):
                raise ConfigError(f"'{arg}' needs a YAML file path after it.")
            config_path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            config_path, i = arg.split("=", 1)[1], i + 1
            continue
        if "=" not in arg:
            raise ConfigError(f"Argument '{arg}' is not KEY=VALUE; write overrides like 'trainer.total_epochs=2'.")
        key, value = arg.split("=", 1)
        key = key.lstrip("+").strip()
        if key.startswith("~"):
            raise ConfigError(f"Deleting keys ('{key}') is not supported; set the key to null instead.")
        overrides.append((key, parse_value(value)))
        i += 1
    return config_path, overrides


def load_yaml(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"Config file '{path}' does not exist; pass an existing YAML file to --config.")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"Config file '{path}' is not valid YAML ({str(e).splitlines()[0]}); fix its syntax.") from e
    if not isinstance(data, dict):
        raise ConfigError(f"Config file '{path}' must hold a mapping at the top level, got {type(data).__name__}.")
    return data


def build_config(cfg: Any, argv: list[str]) -> Any:
    """Fill the default tree `cfg` from `--config file.yaml` and then the CLI overrides, in that order."""
    config_path, overrides = parse_args(argv)
    if config_path:
        apply_dict(cfg, load_yaml(config_path))
    for key, value in overrides:
        set_key(cfg, key, value)
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def overrides_help(command: str, keys_of: str) -> str:
    """What `polyrl <command> --help` prints: the override syntax and where every key is listed."""
    return (f"usage: polyrl {command} [--config FILE.yaml] [KEY=VALUE ...]\n\n"
            f"Every key, with type, default and help: `polyrl keys {keys_of} [PREFIX]` (for example "
            f"`polyrl keys {keys_of} actor_rollout_ref.rollout`), or docs/config_keys.md.")


def key_table(cfg: Any, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) for every leaf, from the dataclasses' field docstrings (see `field_docs`)."""
    rows = []
    docs = field_docs(type(cfg))
    hints = _field_types(cfg)
    for f in dataclasses.fields(cfg):
        val = getattr(cfg, f.name)
        if dataclasses.is_dataclass(val):
            rows.extend(key_table(val, f"{prefix}{f.name}."))
        else:
            rows.append((f"{prefix}{f.name}", _type_name(hints[f.name]), repr(val), docs.get(f.name, "")))
    return rows


def field_docs(cls: type) -> dict[str, str]:
    """Per-field docs: the string literal right after each field (PEP 257 attribute docstrings); a subclass's
    own docs win over its bases'."""
    import ast
    import inspect

    docs = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return docs
    body = tree.body[0].body
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name):
            if isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
                docs[a.target.id] = " ".join(b.value.value.split())
    return docs
