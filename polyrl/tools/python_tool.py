"""`code_interpreter`: runs the model's Python in the sandbox (sandbox.py) and answers with what it printed.

YAML `config:` keys: `timeout` (wall-clock seconds, 10), `cpu_s` (5), `memory_limit_mb` (512, verl's sandbox key),
`max_procs` (16), `warm` (true: each call is a child forked by a warm sandbox, sandbox.py). The sandbox runs in the
loop's thread pool, so concurrent calls overlap."""

from __future__ import annotations

from typing import Any

from polyrl.tools.base import BaseTool, ToolResponse, run_blocking
from polyrl.tools.sandbox import SandboxLimits, run_python

SCHEMA = {"type": "function", "function": {
    "name": "code_interpreter", "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


class PythonTool(BaseTool):
    def __init__(self, config: dict | None = None, tool_schema=None):
        super().__init__(config or {}, tool_schema or SCHEMA)
        c = self.config
        self.limits = SandboxLimits(wall_s=float(c.get("timeout", 10)), cpu_s=int(c.get("cpu_s", 5)),
                                    memory_mb=int(c.get("memory_limit_mb", 512)), max_procs=int(c.get("max_procs", 16)))
        self.warm = bool(c.get("warm", True))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        code = parameters.get("code")
        if not isinstance(code, str):
            return ToolResponse(text="Error: 'code' must be a string."), 0.0, {"error": 1}
        res = await run_blocking(run_python, code, self.limits, self.warm)
        return ToolResponse(text=res.as_text()), 0.0, {"status": res.status, "sandbox_s": res.seconds,
                                                       "error": int(res.status != "ok")}
