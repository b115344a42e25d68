"""`calculator`: evaluates one arithmetic expression (+ - * / // % ** and parentheses on numbers) by walking its AST,
so no Python code runs. Exponents and results are bounded so `9**9**9` answers with an error instead of hanging."""

from __future__ import annotations

import ast
import operator
from typing import Any

from polyrl.tools.base import BaseTool, ToolResponse

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UN = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_ABS = 10**100

SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. 123*456.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError (with the reason) for anything else."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UN:
            return _UN[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > 64:
                raise ValueError("exponent too large")
            out = _BIN[type(node.op)](a, b)
            if abs(out) > MAX_ABS:
                raise ValueError("result too large")
            return out
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"syntax error: {e.msg}") from None
    try:
        value = ev(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


class CalculatorTool(BaseTool):
    def __init__(self, config: dict | None = None, tool_schema=None):
        super().__init__(config or {}, tool_schema or SCHEMA)
        # the expression is the schema's first parameter, whatever its name (the tiny quickstart calls it `e`)
        self.arg = next(iter(self.tool_schema.function.parameters.get("properties") or {}), "expression")

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        expr = parameters.get(self.arg)
        if not isinstance(expr, str):
            return ToolResponse(text=f"Error: '{self.arg}' must be a string."), 0.0, {"error": 1}
        try:
            return ToolResponse(text=str(evaluate(expr))), 0.0, {}
        except ValueError as e:
            return ToolResponse(text=f"Error: {e}"), 0.0, {"error": 1}
