"""The tool YAML (verl's schema) -> tool instances.

    tools:
      - class_name: polyrl.tools.calculator.CalculatorTool     # any importable BaseTool subclass
        config: {type: native}                                  # passed to the tool; `type` must be native
        tool_schema: {type: function, function: {name: ..., description: ..., parameters: {...}}}

Every mistake (a missing file, class or module, a schema that is not an OpenAI function, a duplicate name) is a
ConfigError naming the file and the entry, raised when the trainer is built, before any rollout. verl's `mcp` tools
are not supported (they need an MCP server)."""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml

from polyrl.errors import ConfigError
from polyrl.tools.base import BaseTool, OpenAIFunctionToolSchema

KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"


def import_object(dotted: str, where: str):
    """`pkg.module.Name` -> the object; a ConfigError that names `where` if it does not import."""
    module, _, name = dotted.rpartition(".")
    if not module:
        raise ConfigError(f"{where}: class_name {dotted!r} is not a dotted path such as "
                          "polyrl.tools.calculator.CalculatorTool; give the module and the class.")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{where}: class_name {dotted!r} cannot be imported ({e}); fix the name or install the "
                          "module that defines it.") from None
    return obj


def load_tools(path: str | Path) -> list[BaseTool]:
    """Instantiate every tool the YAML at `path` lists."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{KEY}={str(path)!r} is not a file; point it at a tool YAML (tools: - class_name: ...).")
    try:
        doc = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{KEY}={str(path)!r} is not valid YAML ({str(e).splitlines()[0]}); fix the file.") from None
    entries = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f"{KEY}={str(path)!r} has no `tools:` list; write `tools: [{{class_name: ..., config: "
                          "{type: native}, tool_schema: ...}]`.")
    tools, names = [], set()
    for i, entry in enumerate(entries):
        where = f"{p}: tools[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ConfigError(f"{where} has no class_name; each entry needs class_name, config and tool_schema.")
        config = dict(entry.get("config") or {})
        kind = config.get("type", "native")
        if kind != "native":
            raise ConfigError(f"{where}: config.type={kind!r} is not supported; only native tools run here.")
        cls = import_object(entry["class_name"], where)
        if not (isinstance(cls, type) and issubclass(cls, BaseTool)) and not _verl_shaped(cls):
            raise ConfigError(f"{where}: {entry['class_name']} is not a BaseTool subclass; derive it from "
                              "polyrl.tools.BaseTool.")
        if "tool_schema" not in entry:
            raise ConfigError(f"{where} has no tool_schema; give the tool's OpenAI function schema.")
        schema = OpenAIFunctionToolSchema.parse(entry["tool_schema"], f"{where}.tool_schema")
        if schema.function.name in names:
            raise ConfigError(f"{where}: two tools are named {schema.function.name!r}; give each a unique name.")
        names.add(schema.function.name)
        tools.append(cls(config=config, tool_schema=schema))
    return tools


def _verl_shaped(cls) -> bool:
    """A class with verl's BaseTool methods (e.g. one still importing verl's base while verl is installed)."""
    return isinstance(cls, type) and all(callable(getattr(cls, m, None)) for m in ("create", "execute", "release"))
