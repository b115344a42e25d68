"""Agent loops for multi-turn rollouts (`actor_rollout_ref.rollout.multi_turn`): the loop registry and base class
(base.py), the built-in single_turn_agent and tool_agent (loops.py), the hermes tool-call parser, token-in/token-out
rendering of tool turns (chat.py), the engine as the loops' server (server.py), the OpenAI-compatible endpoint of
`openai_agent` (openai_server.py) and the batch runner the trainer calls (runner.py). Tools live in `polyrl/tools/`."""

from polyrl.agents import loops, openai_server  # noqa: F401  (registers the built-in loops)
from polyrl.agents.base import AGENT_LOOPS, AgentLoopBase, AgentLoopOutput, TokenOutput, register

__all__ = ["AGENT_LOOPS", "AgentLoopBase", "AgentLoopOutput", "TokenOutput", "register"]
