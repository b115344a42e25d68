"""Agent loops: what one trajectory does between the prompt and its last token, registered by name.

    @register("my_agent")
    class MyLoop(AgentLoopBase):
        async def run(self, messages, sampling_params, **kwargs) -> AgentLoopOutput:
            out = await self.server_manager.generate(request_id=..., prompt_ids=..., sampling_params=sampling_params)
            ...

A sample picks its loop by the data column `agent_name` (default `rollout.agent.default_agent_loop`); loops of your
own are registered by a YAML list at `rollout.agent.agent_loop_config_path` (verl's `- name: ..., _target_: ...`).
verl's shapes are kept (`AgentLoopBase.run`, `AgentLoopOutput`, `server_manager.generate`); the server here is
polyrl's engine in the same process (server.py), not an HTTP server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from polyrl.errors import ConfigError

AGENT_LOOPS: dict[str, type] = {}


def register(name: str):
    def deco(cls):
        AGENT_LOOPS[name] = cls
        return cls

    return deco


@dataclass
class TokenOutput:
    """One assistant turn from the engine: the sampled ids and their log-probs, exactly as sampled."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # stop | length
    weight_version: int = 0


@dataclass
class AgentLoopOutput:
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]  # 1: sampled by the model (trained on), 0: tool tokens
    response_logprobs: list[float]
    num_turns: int = 1  # assistant + user(tool) turns + 1 for the prompt, as verl counts
    reward_score: float | None = None  # a loop's own reward; None: the reward function's
    tool_rewards: list[float] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    weight_versions: list[int] = field(default_factory=list)  # per assistant turn: the weights that sampled it
    messages: list[dict] | None = None  # with data.return_raw_chat: the conversation, tool turns included


class AgentLoopBase:
    """One trajectory's loop. `self.server_manager` samples turns, `self.tokenizer` renders, `self.tools` maps tool
    names to tools, `self.config` is the multi_turn config, `self.renderer` the tool-turn renderer."""

    def __init__(self, *, server_manager, tokenizer, tools: dict, config, renderer, response_length: int,
                 tool_pool=None):
        self.server_manager, self.tokenizer, self.tools, self.config = server_manager, tokenizer, tools, config
        self.renderer, self.response_length, self.tool_pool = renderer, response_length, tool_pool

    async def run(self, messages: list[dict], sampling_params: dict, **kwargs: Any) -> AgentLoopOutput:
        raise NotImplementedError


def load_agent_loops(path: str | None) -> None:
    """Register the loops listed in `agent.agent_loop_config_path` (ConfigError for a bad file or class)."""
    if not path:
        return
    from polyrl.tools.registry import import_object

    key = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{key}={path!r} is not a file; point it at a YAML list of `- name: ..., _target_: ...`.")
    doc = yaml.safe_load(p.read_text())
    if not isinstance(doc, list):
        raise ConfigError(f"{key}={path!r} is not a YAML list; write `- name: my_agent\\n  _target_: pkg.mod.Loop`.")
    for i, entry in enumerate(doc):
        where = f"{p}: entry {i}"
        if not isinstance(entry, dict) or "name" not in entry or "_target_" not in entry:
            raise ConfigError(f"{where} needs `name` and `_target_` (the loop's class as pkg.module.Class).")
        cls = import_object(entry["_target_"], where)
        if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
            raise ConfigError(f"{where}: {entry['_target_']} is not a subclass of polyrl.agents.AgentLoopBase.")
        AGENT_LOOPS[entry["name"]] = cls
