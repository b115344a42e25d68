"""Run a batch of samples through their agent loops on one engine: `AgentRunner.generate(engine, samples, sampling)`
returns a `Generation` (prompt-major rows, n per sample) with each row's response mask (0 on tool tokens), tool
rewards, turn counts and the rollout's metrics, which the trainer turns into its batch.

Everything a user can get wrong (the tool YAML, a schema, the format, an `agent_name` nobody registered, a custom loop
file) is checked in `__init__` and `check_samples`, which the trainer calls before it loads the model.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from polyrl.agents import loops as _builtin_loops  # noqa: F401  (registers single_turn_agent and tool_agent)
from polyrl.agents.base import AGENT_LOOPS, AgentLoopOutput, load_agent_loops
from polyrl.agents.chat import ToolTurnRenderer
from polyrl.agents.server import EngineServer
from polyrl.agents.tool_parser import PARSERS
from polyrl.errors import ConfigError
from polyrl.rollout.base import Generation, SamplingParams
from polyrl.tools.registry import load_tools

KEY = "actor_rollout_ref.rollout.multi_turn"
TRUNCATE_SIDES = ("left", "right", "middle")


@dataclass
class AgentGeneration(Generation):
    prompt_ids: list[list[int]] = field(default_factory=list)  # per row: the first turn's prompt (tool schemas shown)
    response_masks: list[list[int]] = field(default_factory=list)
    tool_rewards: list[float] = field(default_factory=list)  # per row: the sum of its tools' step rewards
    reward_scores: list[float | None] = field(default_factory=list)  # per row: its loop's own reward, if it set one
    num_turns: list[int] = field(default_factory=list)
    weight_versions: list[list[int]] = field(default_factory=list)  # per row, per assistant turn
    messages: list[list[dict] | None] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


class AgentRunner:
    def __init__(self, rollout_cfg, tokenizer, *, response_length: int, template_kwargs: dict | None = None,
                 keep_messages: bool = False):
        mt, agent = rollout_cfg.multi_turn, rollout_cfg.agent
        self.cfg, self.tokenizer, self.response_length, self.keep_messages = mt, tokenizer, response_length, \
            keep_messages
        if mt.format not in PARSERS:
            raise ConfigError(f"{KEY}.format={mt.format!r} is not a tool-call format polyrl parses; use one of "
                              f"{sorted(PARSERS)}.")
        if mt.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ConfigError(f"{KEY}.tool_response_truncate_side={mt.tool_response_truncate_side!r} is not one of "
                              f"{list(TRUNCATE_SIDES)}.")
        if mt.max_parallel_calls < 1 or mt.max_tool_response_length < 1:
            raise ConfigError(f"{KEY}.max_parallel_calls={mt.max_parallel_calls} and max_tool_response_length="
                              f"{mt.max_tool_response_length} must be >= 1.")
        if mt.tool_timeout_s <= 0 or mt.trajectory_timeout_s <= 0:
            raise ConfigError(f"{KEY}.tool_timeout_s and trajectory_timeout_s must be > 0 (seconds).")
        load_agent_loops(agent.agent_loop_config_path)
        self.default_loop = agent.default_agent_loop
        self._check_name(self.default_loop, "actor_rollout_ref.rollout.agent.default_agent_loop")
        tools = load_tools(mt.tool_config_path) if mt.tool_config_path else []
        self.tools = {t.name: t for t in tools}
        schemas = [t.tool_schema.model_dump() for t in tools] or None
        self.renderer = ToolTurnRenderer(tokenizer, template_kwargs, tools=schemas)
        self.tools_shown = schemas is not None
        self.num_workers = max(1, agent.num_workers)

    @staticmethod
    def _check_name(name: str, where: str) -> None:
        if name not in AGENT_LOOPS:
            raise ConfigError(f"{where}={name!r} names no registered agent loop; use one of {sorted(AGENT_LOOPS)} or "
                              "register yours with actor_rollout_ref.rollout.agent.agent_loop_config_path.")

    def check_samples(self, samples, where: str) -> None:
        for s in samples:
            name = getattr(s, "agent_name", None)
            if name is not None:
                self._check_name(name, f"{where}: row {s.index}'s agent_name")
            kw = s.extra_info.get("tools_kwargs")
            if kw is not None and not isinstance(kw, dict):
                raise ConfigError(f"{where}: row {s.index}'s extra_info.tools_kwargs is {type(kw).__name__}; it must "
                                  "map tool names to {create_kwargs: {...}}.")

    def prompt_ids(self, sample) -> list[int]:
        """The first turn's prompt: the data path's ids, or the raw chat re-rendered with the tool schemas."""
        return self.renderer.prompt_ids(sample.raw_prompt) if self.tools_shown else list(sample.prompt_ids)

    def generate(self, engine, samples, sampling: SamplingParams, weight_version: int = 0) -> AgentGeneration:
        return asyncio.run(self._generate(engine, samples, sampling, weight_version))

    async def _generate(self, engine, samples, sampling, weight_version) -> AgentGeneration:
        server = EngineServer(engine, replace_n(sampling), weight_version=weight_version)
        pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="polyrl-tool")
        n = sampling.n
        jobs = []
        for p, s in enumerate(samples):
            ids = self.prompt_ids(s)
            for j in range(n):
                loop_cls = AGENT_LOOPS[getattr(s, "agent_name", None) or self.default_loop]
                loop = loop_cls(server_manager=server, tokenizer=self.tokenizer, tools=self.tools, config=self.cfg,
                                renderer=self.renderer, response_length=self.response_length, tool_pool=pool)
                jobs.append(self._one(server, loop, f"{p}-{j}", s, ids))
        server.num_live = len(jobs)
        t0 = time.perf_counter()
        pump = asyncio.create_task(server.pump())
        try:
            outs: list[AgentLoopOutput] = await asyncio.gather(*jobs)
            await pump
        finally:
            pump.cancel()
            server.close()
            pool.shutdown(wait=False, cancel_futures=True)
        server.stats["wall_s"] = time.perf_counter() - t0
        return self.collect(outs, n, server.stats)

    async def _one(self, server: EngineServer, loop, rid: str, sample, ids) -> AgentLoopOutput:
        try:
            return await loop.run(sample.raw_prompt, {}, request_id=rid, prompt_ids=ids,
                                  tools_kwargs=sample.extra_info.get("tools_kwargs") or {},
                                  keep_messages=self.keep_messages, sample=sample)
        finally:
            server.num_live -= 1
            server.finish(rid)

    def start(self, engine, sampling: SamplingParams, budget: int) -> "InFlightAgents":
        """Trajectories that outlive a generation call (partial rollouts): see `InFlightAgents`."""
        return InFlightAgents(self, engine, sampling, budget)

    def collect(self, outs: list[AgentLoopOutput], n: int, stats: dict) -> AgentGeneration:
        """The loops' outputs (n per sample, prompt-major) as a generation, with the metrics of the server `stats`
        that produced them."""
        turns = [o.num_turns for o in outs]
        calls = sum(o.metrics.get("tool_calls", 0) for o in outs)
        metrics = {
            "num_turns/mean": float(np.mean(turns)), "num_turns/max": float(max(turns)),
            "num_turns/min": float(min(turns)),
            "tool_calls/total": float(calls), "tool_calls/mean": calls / len(outs),
            "tool_calls/errors": float(sum(o.metrics.get("tool_errors", 0) for o in outs)),
            # a trajectory's seconds in tool calls (a free tool worker waited for included): the mean and the slowest,
            # not a sum (trajectories' calls overlap; a sum read as a stage of the step was many times the step)
            "timing_s/tool_calls": float(np.mean([o.metrics.get("tool_s", 0.0) for o in outs])),
            "timing_s/tool_calls_max": float(max(o.metrics.get("tool_s", 0.0) for o in outs)),
            "agent/client_timeouts": float(sum(o.metrics.get("client_timeouts", 0) for o in outs)),  # openai_agent
            "rollout/prefill_tokens_saved": float(stats["prefill_tokens_saved"]),
            "rollout/prefill_tokens": float(stats["prefill_tokens"]),
            "rollout/num_generate_calls": float(stats["num_generate_calls"]),
            # the engine idle while trajectories were live (waiting on tools, or on the batching of their turns)
            "rollout/engine_idle_s": max(0.0, stats["wall_s"] - stats["engine_s"]),
        }
        return AgentGeneration(
            prompt_index=[i // n for i in range(len(outs))], token_ids=[o.response_ids for o in outs],
            logprobs=[o.response_logprobs for o in outs],
            finish_reason=["length" if len(o.response_ids) >= self.response_length else "stop" for o in outs],
            response_masks=[o.response_mask for o in outs],
            tool_rewards=[float(sum(o.tool_rewards)) for o in outs], reward_scores=[o.reward_score for o in outs],
            num_turns=turns, weight_versions=[o.weight_versions for o in outs], messages=[o.messages for o in outs],
            metrics=metrics, prompt_ids=[o.prompt_ids for o in outs])


class InFlightAgents:
    """Agent trajectories that live across generation calls, for partial rollouts (trainer/partial_rollout.py): one
    event loop, server and tool pool kept between calls. `add` starts each sample's n loops; `run(version)` is one
    call, in which every live trajectory samples up to `budget` tokens (its tools run between its turns) under
    weights `version`, and then waits, parked on its kept cache, for the next call (server.py); `collect` turns
    finished trajectories into a generation whose metrics count the server's work since the last `collect`."""

    def __init__(self, runner: AgentRunner, engine, sampling: SamplingParams, budget: int):
        self.runner, self.n = runner, sampling.n
        self.loop = asyncio.new_event_loop()
        self.server = EngineServer(engine, replace_n(sampling), budget=budget)
        self.pool = ThreadPoolExecutor(runner.num_workers, thread_name_prefix="polyrl-tool")
        self.tasks: list[asyncio.Task] = []
        self.num_started = 0
        self.since = {**self.server.stats, "wall_s": 0.0}  # the stats at the last `collect`
        self.wall_s = 0.0

    def add(self, sample) -> list[asyncio.Task]:
        """Start `sample`'s n trajectories (they run in the next `run`)."""
        r, ids, tasks = self.runner, self.runner.prompt_ids(sample), []
        for j in range(self.n):
            loop_cls = AGENT_LOOPS[getattr(sample, "agent_name", None) or r.default_loop]
            loop = loop_cls(server_manager=self.server, tokenizer=r.tokenizer, tools=r.tools, config=r.cfg,
                            renderer=r.renderer, response_length=r.response_length, tool_pool=self.pool)
            rid = f"{self.num_started}-{j}"
            tasks.append(self.loop.create_task(r._one(self.server, loop, rid, sample, ids)))
        self.num_started += 1
        self.server.num_live += self.n
        self.tasks += tasks
        return tasks

    def run(self, version: int) -> None:
        """One generation call under weights `version`; raises the first trajectory's failure, if any."""
        t0 = time.perf_counter()
        self.server.new_phase(version)
        self.loop.run_until_complete(self.server.pump())
        self.wall_s += time.perf_counter() - t0
        self.tasks = [t for t in self.tasks if not t.done() or t.exception() is not None]
        for t in self.tasks:
            if t.done():
                raise t.exception()

    def collect(self, outs: list[AgentLoopOutput]) -> AgentGeneration:
        stats = {**self.server.stats, "wall_s": self.wall_s}
        delta = {k: v - self.since[k] for k, v in stats.items()}
        self.since = stats
        return self.runner.collect(outs, self.n, delta)

    def close(self) -> None:
        """Stop the trajectories still in flight and let their caches go."""
        async def cancel(tasks):
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.loop.run_until_complete(cancel(self.tasks))
        self.server.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.loop.close()


def replace_n(sampling: SamplingParams) -> SamplingParams:
    return replace(sampling, n=1)


def build_agent_runner(cfg, tokenizer, datasets: list[tuple[str, list]]) -> AgentRunner | None:
    """The trainer's runner when `multi_turn.enable`, after checking every sample it will run (agent_name,
    tools_kwargs, the prompt with the tool schemas within data.max_prompt_length); None for single-turn runs."""
    r = cfg.actor_rollout_ref.rollout
    if not r.multi_turn.enable:
        return None
    runner = AgentRunner(r, tokenizer, response_length=r.response_length or cfg.data.max_response_length,
                         template_kwargs=cfg.data.apply_chat_template_kwargs, keep_messages=cfg.data.return_raw_chat)
    for where, samples in datasets:
        runner.check_samples(samples, where)
        if runner.tools_shown:
            longest = max((len(runner.prompt_ids(s)) for s in samples), default=0)
            if longest > cfg.data.max_prompt_length:
                raise ConfigError(f"{where}: with the tool schemas of {KEY}.tool_config_path the longest prompt has "
                                  f"{longest} tokens, over data.max_prompt_length={cfg.data.max_prompt_length}; "
                                  "raise data.max_prompt_length.")
    return runner
