"""verl's module path `verl.tools.schemas` (the tool schema and response types)."""

from polyrl.tools.base import OpenAIFunctionSchema, OpenAIFunctionToolSchema, ToolResponse

__all__ = ["OpenAIFunctionSchema", "OpenAIFunctionToolSchema", "ToolResponse"]
