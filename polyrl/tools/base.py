"""The tool interface, shaped like verl's `verl.tools.base_tool.BaseTool`, so a verl tool ports by changing its imports.

A tool instance lives for one call (as in verl's ToolAgentLoop): `create` -> `execute` -> `calc_reward` -> `release`.
`execute` returns `(ToolResponse, step_reward, metrics)`; the step rewards of a trajectory are summed into its score.
The schema is an OpenAI function (`{"type": "function", "function": {"name", "description", "parameters"}}`), checked
here so a malformed one ends the run with one sentence before any rollout.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

from polyrl.errors import ConfigError


@dataclass
class ToolResponse:
    """What a tool hands back to the model (verl's `ToolResponse`; only text is rendered here)."""

    text: str | None = None
    image: Any = None
    video: Any = None


@dataclass
class OpenAIFunctionSchema:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}, "required": []})
    strict: bool = False


@dataclass
class OpenAIFunctionToolSchema:
    """verl's `OpenAIFunctionToolSchema`: `{"type": "function", "function": {...}}`."""

    type: str
    function: OpenAIFunctionSchema

    @classmethod
    def parse(cls, raw: Any, where: str = "tool_schema") -> "OpenAIFunctionToolSchema":
        """Validate an OpenAI function schema (a dict); a ConfigError names what is wrong."""
        hint = ("it must be an OpenAI function: {type: function, function: {name: ..., description: ..., "
                "parameters: {type: object, properties: {...}, required: [...]}}}")
        if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(raw.get("function"), dict):
            raise ConfigError(f"{where} is {raw!r:.120}; {hint}.")
        fn = raw["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"{where}.function.name is {name!r}; {hint} (the name a valid identifier).")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type") != "object" \
                or not isinstance(params.get("properties", {}), dict):
            raise ConfigError(f"{where}.function.parameters is {params!r:.120}; {hint}.")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ConfigError(f"{where}.function has unknown keys {sorted(unknown)}; {hint}.")
        return cls(type="function", function=OpenAIFunctionSchema(
            name=name, description=str(fn.get("description", "")), parameters=params,
            strict=bool(fn.get("strict", False))))

    def model_dump(self, exclude_unset: bool = True, exclude_none: bool = True) -> dict:
        """The plain dict (pydantic's name, as verl's loop calls it) that chat templates take in `tools=`."""
        f = self.function
        fn = {"name": f.name, "description": f.description, "parameters": f.parameters}
        if f.strict:
            fn["strict"] = True
        return {"type": "function", "function": fn}


class BaseTool:
    """A tool the model may call. Subclass it and override `execute` (and `create`/`calc_reward`/`release` when the
    tool keeps per-call state). `config` is the YAML's `config:` block; `tool_schema` the OpenAI function."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | dict):
        self.config = dict(config or {})
        if isinstance(tool_schema, dict):
            tool_schema = OpenAIFunctionToolSchema.parse(tool_schema)
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        self.name = self.tool_schema.function.name
        self._instances: dict[str, dict] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        """Start one call's state; kwargs carry the sample's `extra_info.tools_kwargs.<tool>.create_kwargs`
        (as `create_kwargs=` from the loop, verl's calling convention)."""
        instance_id = instance_id or uuid4().hex
        self._instances[instance_id] = dict(kwargs.get("create_kwargs") or {})
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float,
                                                                                             dict]:
        """Run the tool: (response, step reward, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


async def run_blocking(fn, *args):
    """Run a blocking function in the default thread pool, so a synchronous tool never blocks the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
