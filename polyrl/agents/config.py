"""`actor_rollout_ref.rollout.multi_turn.*` and `actor_rollout_ref.rollout.agent.*`: verl's names and defaults
(verl's `rollout.yaml`, read 2026-11). Where polyrl differs, the field's docstring says so."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MultiTurnConfig:
    enable: bool = False
    """Run each sample through its agent loop (data column `agent_name`, default `agent.default_agent_loop`);
    tool_agent samples call the tools of tool_config_path between assistant turns."""
    max_assistant_turns: int | None = None
    """Most assistant (sampled) turns per trajectory; null: until the response budget or a turn without a tool call."""
    max_user_turns: int | None = None
    """Most tool-response turns per trajectory; null: no cap."""
    max_parallel_calls: int = 1
    """Tool calls of one assistant turn that run (concurrently); later ones in the same turn are dropped, as verl."""
    max_tool_response_length: int = 256
    """A tool response longer than this many characters is cut (verl compares the string length, not tokens)."""
    tool_response_truncate_side: str = "middle"
    """Which side of a long tool response is cut: left (keep the end), right (keep the start) or middle (keep both
    ends). polyrl's left/right mean what data.truncation's do; verl's code before its PR #6313 kept the start for left."""
    tool_config_path: str | None = None
    """Tool YAML in verl's schema (tools: - class_name, config: {type: native}, tool_schema: {OpenAI function})."""
    format: str = "hermes"
    """Tool-call format the model writes: hermes (<tool_call>{"name": ..., "arguments": {...}}</tool_call>) is the one
    parsed here."""
    tool_timeout_s: float = 30.0
    """(polyrl) Wall-clock limit of one tool call; past it the model gets an error message as the tool response."""
    trajectory_timeout_s: float = 600.0
    """(polyrl) Wall-clock limit of one trajectory's tool time in total (openai_agent: of its client's whole run); past
    it the trajectory ends where it is."""


@dataclass
class AgentConfig:
    num_workers: int = 8
    """Threads that run tool calls (verl: agent-loop worker processes); a tool's `execute` may also use its own pool."""
    default_agent_loop: str = "single_turn_agent"
    """Loop for samples without an `agent_name` column; with multi_turn.enable and a tool_config_path, use tool_agent
    to let every sample call tools."""
    agent_loop_config_path: str | None = None
    """YAML list of your own loops, verl's format: `- name: my_agent\n  _target_: my_pkg.loops.MyLoop` (a subclass
    of polyrl.agents.AgentLoopBase)."""
