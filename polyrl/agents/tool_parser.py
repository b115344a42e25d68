"""Tool calls in the model's text. `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number
per turn. A call that does not parse is returned as a `ParseError` in its place, so the loop answers it with an error
message instead of crashing (the model learns from the message)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class FunctionCall:
    name: str
    arguments: dict


@dataclass
class ParseError:
    message: str


def parse_hermes(text: str) -> list[FunctionCall | ParseError]:
    calls: list[FunctionCall | ParseError] = []
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ParseError(f"Error: the tool call is not valid JSON ({e.msg} at char {e.pos})."))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ParseError('Error: a tool call must be {"name": ..., "arguments": {...}}.'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                calls.append(ParseError(f"Error: invalid JSON in arguments for '{obj['name']}'."))
                continue
        if not isinstance(args, dict):
            calls.append(ParseError(f"Error: the arguments for '{obj['name']}' must be a JSON object."))
            continue
        calls.append(FunctionCall(obj["name"], args))
    if not calls and "<tool_call>" in text:  # opened, never closed
        calls.append(ParseError("Error: <tool_call> was not closed with </tool_call>."))
    return calls


PARSERS = {"hermes": parse_hermes}
