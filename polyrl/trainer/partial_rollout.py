"""Partial rollouts for the one-step off-policy pipeline (`async_training.partial_rollout=True`).

A GRPO batch waits for its longest response: with long-tailed lengths the rollout GPU spends its last thousands of
decode steps on a few rows, reading all the weights each step for them. With partial rollouts each generation call
decodes at most `async_training.partial_rollout_max_new_tokens` tokens per row; a row that reaches that cap without
finishing stays in flight and continues in the next call, beside the next batch's new rows, with whatever weights
the rollout has then. A batch ships the prompt groups whose n rows have all finished, oldest first.

How a row continues: its prompt plus the tokens it has so far are the next call's prompt. The native engine keeps
the row's KV cache between the two calls (`SamplingParams.keep_unfinished`, `Generation.handles`), across the
weight update between them, and feeds only its last token; where no cache was kept (the hf engine, a cache released
by an OOM retry, more rows than engine seats) the prompt is prefilled again under the current weights, as vLLM's
recompute preemption. Every token keeps the log-prob the engine sampled it with,
so the batch's pi_old is the engine's, token by token, across both weight versions (async_ppo.py's default); each
row is tagged with the first and last weight version that generated it, and its staleness counts from the first.

MoE routing replay (R3): every call returns a continued row's routes over its whole sequence (prompt, the tokens so
far, the new ones), so a row keeps its latest call's. On a kept cache the earlier positions' routes are the ones
recorded when their K/V was computed, under the weights that sampled them; a recomputed prefix gets the re-prefill's
routes under the current weights, as its K/V does.

Multi-turn (`rollout.multi_turn.enable`, `AgentPartialRollouts`): a group's rows are agent trajectories that live
across calls (agents/runner.py's `InFlightAgents`). In each call every trajectory in flight samples up to the cap,
across its turns, with its tools running between them; a turn stopped at the cap waits on its kept cache and
continues in the next call. Each turn is tagged with the weights version that sampled its first token, so the turns
of one trajectory may carry different versions; the row's first and last versions are its oldest and newest turns'.

Data position: a batch carries the sampler state before the oldest draw still in flight, so a resumed run draws
those prompts again. Groups of that draw that had already shipped are then trained once more; none is lost.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from polyrl.rollout.base import Generation


@dataclass(eq=False)
class Row:
    """One sample of a prompt group, possibly still in flight (compared by identity)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    done: bool = False
    first_version: int | None = None
    last_version: int | None = None
    handle: object = None  # the engine's kept KV cache of this row (native engine), None: recompute it
    routes: object = None  # R3: int16 [len(prompt) + len(tokens), moe layers, k] from the latest call (module doc)


@dataclass(eq=False)
class Group:
    sample: object  # the dataset's RLSample
    rows: list[Row]
    draw_state: dict  # the sampler's state before the draw this group came from

    @property
    def done(self) -> bool:
        return all(r.done for r in self.rows)


class PartialRollouts:
    """The groups in flight, in the order they were drawn. `requests` -> engine -> `absorb`, then `take` the
    finished groups."""

    def __init__(self, n: int, max_response_length: int, max_new_tokens: int):
        self.n, self.max_len, self.cap = n, max_response_length, max_new_tokens
        self.groups: list[Group] = []

    def add(self, samples: list, draw_state: dict) -> None:
        self.groups += [Group(s, [Row() for _ in range(self.n)], draw_state) for s in samples]

    def requests(self) -> tuple[list[list[int]], list[Row], list[int]]:
        """One engine prompt per unfinished row (its prompt + its tokens so far), the rows they continue, and each
        row's new-token limit for this call (the cap, or what is left of the response length)."""
        rows = [(g, r) for g in self.groups for r in g.rows if not r.done]
        caps = [min(self.cap, self.max_len - len(r.tokens)) for _, r in rows]
        return [list(g.sample.prompt_ids) + r.tokens for g, r in rows], [r for _, r in rows], caps

    def absorb(self, out: Generation, rows: list[Row], caps: list[int], version: int) -> None:
        """Append one call's output (one engine row per request, n=1) to the rows it continued."""
        assert len(out.token_ids) == len(rows) == len(caps), (len(out.token_ids), len(rows), len(caps))
        for i, (row, cap, toks, lps, reason) in enumerate(zip(rows, caps, out.token_ids, out.logprobs,
                                                             out.finish_reason)):
            row.tokens += toks
            row.logprobs += lps
            row.finish_reason = reason
            row.first_version = version if row.first_version is None else row.first_version
            row.last_version = version
            row.handle = out.handles[i] if out.handles is not None else None
            row.routes = out.routed_experts[i] if out.routed_experts is not None else None
            # in flight only when this call stopped it at the cap (not at a stop token, its own end, or the limit)
            row.done = reason == "stop" or len(toks) < cap or len(row.tokens) >= self.max_len

    def num_done(self) -> int:
        return sum(g.done for g in self.groups)

    def take(self, num: int) -> list[Group]:
        """Up to `num` finished groups, oldest first; they leave the pool."""
        out = [g for g in self.groups if g.done][:num]
        taken = {id(g) for g in out}
        self.groups = [g for g in self.groups if id(g) not in taken]
        return out

    def resume_state(self) -> dict | None:
        """The sampler state a resumed run restarts from: before the oldest draw still held (None: nothing held)."""
        return self.groups[0].draw_state if self.groups else None

    def part(self, groups: list[Group]) -> tuple[list, Generation]:
        return as_part(groups)

    def close(self) -> None:
        """Let go of what the engine keeps for the rows in flight (nothing here: their caches go with the engine)."""


@dataclass(eq=False)
class Trajectory:
    """A multi-turn row: one agent loop in flight (its asyncio task yields an `AgentLoopOutput`). Its versions are its
    turns' oldest and newest; a loop that tags no turns gets the calls it ran in."""

    task: object
    start: int | None = None  # the version of the first call it ran in
    end: int | None = None  # the version of the call it finished in

    @property
    def done(self) -> bool:
        return self.task.done()

    @property
    def first_version(self) -> int:
        return min(self.task.result().weight_versions or [self.start])

    @property
    def last_version(self) -> int:
        return max(self.task.result().weight_versions or [self.end])


class AgentPartialRollouts(PartialRollouts):
    """Partial rollouts of agent trajectories (module docstring, Multi-turn): `add`, then `run(version)` for each
    generation call, then `take` the finished groups and turn them into a `part`."""

    def __init__(self, agents):
        super().__init__(agents.n, 0, 0)  # the length and the cap are the agents' (response_length, budget)
        self.agents = agents

    def add(self, samples: list, draw_state: dict) -> None:
        self.groups += [Group(s, [Trajectory(t) for t in self.agents.add(s)], draw_state) for s in samples]

    def run(self, version: int) -> int:
        """One generation call under weights `version`; returns how many parked turns it continued."""
        rows = [r for g in self.groups for r in g.rows if not r.done]
        for r in rows:
            r.start = version if r.start is None else r.start
        before = self.agents.server.stats["turns_continued"]
        self.agents.run(version)
        for r in rows:
            if r.done:
                r.end = version
        return self.agents.server.stats["turns_continued"] - before

    def part(self, groups: list[Group]) -> tuple[list, Generation]:
        return [g.sample for g in groups], self.agents.collect([r.task.result() for g in groups for r in g.rows])

    def close(self) -> None:
        self.agents.close()


def as_part(groups: list[Group]) -> tuple[list, Generation]:
    """The finished groups as one part for `RolloutBatchMixin._assemble_batch`: prompts and prompt-major rows."""
    rows = [(i, r) for i, g in enumerate(groups) for r in g.rows]
    routes = [r.routes for _, r in rows]
    out = Generation(prompt_index=[i for i, _ in rows], token_ids=[r.tokens for _, r in rows],
                     logprobs=[r.logprobs for _, r in rows], finish_reason=[r.finish_reason for _, r in rows],
                     routed_experts=routes if all(x is not None for x in routes) else None)
    return [g.sample for g in groups], out


def row_metrics(groups: list[Group]) -> dict[str, float]:
    rows = [r for g in groups for r in g.rows]
    spans = [r.last_version - r.first_version for r in rows]
    return {"async/partial_rollout/frac_rows_resumed": sum(s > 0 for s in spans) / len(rows),
            "async/partial_rollout/version_span_max": float(max(spans))}


def continuation_sampling(sampling, rows: list[Row], caps: list[int]):
    """One engine row per request: every row is its own prompt (n=1), with its own new-token limit; rows stopped by
    the cap keep their KV cache, and rows that kept one continue on it (engines without a cache recompute)."""
    return dataclasses.replace(sampling, n=1, max_new_tokens=max(caps), max_new_tokens_per_row=caps,
                               keep_unfinished=True, continuations=[r.handle for r in rows])
