"""Agent tools for multi-turn rollouts: the `BaseTool` interface (verl's shape), the tool YAML loader, and the
built-in tools: `calculator` (calculator.py) and `code_interpreter` (python_tool.py, in the sandbox of sandbox.py).
The loops that call them live in `polyrl/agents/`."""

from polyrl.tools.base import BaseTool, OpenAIFunctionSchema, OpenAIFunctionToolSchema, ToolResponse
from polyrl.tools.registry import load_tools

__all__ = ["BaseTool", "OpenAIFunctionSchema", "OpenAIFunctionToolSchema", "ToolResponse", "load_tools"]
