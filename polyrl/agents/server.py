"""The engine as the agent loops' `server_manager`: every trajectory is its own request, and the turns that are ready
together are sampled together.

`generate(request_id, prompt_ids, ...)` parks the request; a pump batches the parked requests into one
`engine.generate` call (in one engine thread, so tools keep running meanwhile) once every live trajectory is waiting
for the engine, or a window after the first one arrived (trajectories whose tools are slow do not hold the others
back: they join a later call). The window is `coalesce_s` or a quarter of the last engine call, whichever is longer:
a turn left out costs a call of its own, which at decode sizes takes nearly as long as the full batch, so waiting a
fraction of a call for a straggling tool is cheaper; and a window long against scheduling noise keeps a call's rows,
hence its samples, the same from run to run (rows go in the trajectories' order; a seed then fixes the rollout). A
request's KV cache is kept between its turns (`SamplingParams.keep_cache`, the native engine's `KeptRow`), so a turn
prefills only the tokens that are new since the last one: the tool turn, plus the last sampled token whose K/V was
not written yet. `stats['prefill_tokens_saved']` counts the rest. Fresh requests that share a prompt (the GRPO group
of the first turn) go in as one prompt with n samples, so the prompt is prefilled once. Backends without kept caches
(hf) re-prefill every turn; the tokens are the same.

Partial rollouts (`budget`, trainer/partial_rollout.py): a pump is one generation call of the off-policy rollout,
in which each trajectory samples at most `budget` tokens. A turn that reaches the budget is parked unanswered, on its
kept cache, and its pump ends once every live trajectory is parked; `new_phase(version)` gives every trajectory a
fresh budget under the weights version loaded meanwhile, and the parked turns continue where they stopped. A turn
is tagged with the version that sampled its first token.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from polyrl.agents.base import TokenOutput
from polyrl.rollout.base import SamplingParams


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    max_new: int
    future: asyncio.Future
    tokens: list[int] = field(default_factory=list)  # sampled so far (a turn parked at the budget continues)
    logprobs: list[float] = field(default_factory=list)
    version: int | None = None  # the weights version that sampled its first token


class EngineServer:
    WAIT_FRACTION = 0.25  # of the last engine call: the longest a ready turn waits for others (module docstring)

    def __init__(self, engine, sampling: SamplingParams, weight_version: int = 0, coalesce_s: float = 0.02,
                 budget: int | None = None):
        self.engine, self.sampling, self.weight_version, self.coalesce_s = engine, sampling, weight_version, coalesce_s
        self.budget = budget  # partial rollouts: tokens a trajectory samples per pump (module docstring)
        self.used: dict[str, int] = {}  # request id -> tokens sampled in this pump
        self.parked: list[_Request] = []  # turns waiting for the next phase
        self.pending: list[_Request] = []
        self.handles: dict[str, object] = {}  # request id -> the engine's kept cache of its last turn
        self.order: dict[str, int] = {}  # request id -> when it first asked: a call's rows go in this order
        self.released: list = []
        self.num_live = 0  # trajectories still running (set by the runner)
        self.stats = {"prefill_tokens_saved": 0, "prefill_tokens": 0, "num_generate_calls": 0, "engine_s": 0.0,
                      "turns_continued": 0}
        self.last_call_s = 0.0  # the last engine call's seconds (the coalescing window, module docstring)
        self._wake: asyncio.Event | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="polyrl-engine")

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict | None = None,
                       max_new_tokens: int | None = None, **_) -> TokenOutput:
        fut = asyncio.get_running_loop().create_future()
        self.order.setdefault(request_id, len(self.order))
        self.pending.append(_Request(request_id, list(prompt_ids), max_new_tokens or self.sampling.max_new_tokens, fut))
        self._kick()
        return await fut

    def finish(self, request_id: str) -> None:
        """A trajectory ended: its kept cache is let go before the next engine call."""
        self.order.pop(request_id, None)
        h = self.handles.pop(request_id, None)
        if h is not None:
            self.released.append(h)
        self._kick()

    def _kick(self):
        if self._wake is not None:
            self._wake.set()

    def new_phase(self, version: int) -> None:
        """Partial rollouts: the next pump samples under weights `version`, each trajectory `budget` tokens more; the
        parked turns go first."""
        self.weight_version = version
        self.used.clear()
        self.stats["turns_continued"] += len(self.parked)
        self.pending, self.parked = self.parked + self.pending, []

    async def pump(self) -> None:
        """Serve requests until no trajectory is live (or, with a budget, every live one is parked)."""
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        while self.num_live > len(self.parked) or self.pending:
            if not self.pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            deadline = loop.time() + max(self.coalesce_s, self.WAIT_FRACTION * self.last_call_s)
            while len(self.pending) < self.num_live - len(self.parked) and loop.time() < deadline:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
            # rows in the trajectories' own order, not in the order their tools happened to finish: the engine's
            # random stream is dealt to rows by position, so a call's samples then depend on its rows alone
            batch, self.pending = sorted(self.pending, key=lambda r: self.order[r.request_id]), []
            try:
                outs = await loop.run_in_executor(self._thread, self._generate, batch)
            except Exception as e:  # an engine failure ends every waiting trajectory with it (the trainer sees it)
                for r in batch:
                    r.future.set_exception(e)
                continue
            for r, o in zip(batch, outs):
                if o is None:  # stopped at the budget: continues in the next phase
                    self.parked.append(r)
                else:
                    r.future.set_result(o)

    def close(self) -> None:
        """Let every kept cache go (the rollout is over)."""
        self.released += [h for h in self.handles.values() if h is not None]
        self.handles.clear()
        self._release()
        self._thread.shutdown(wait=True)

    def _release(self):
        if self.released and hasattr(self.engine, "release_kept"):
            self.engine.release_kept(self.released)
        self.released = []

    def _limit(self, r: _Request) -> int:
        """New tokens `r` may sample in this call: what its turn has left, within its trajectory's budget."""
        left = r.max_new - len(r.tokens)
        return left if self.budget is None else min(left, self.budget - self.used.get(r.request_id, 0))

    def _generate(self, requests: list[_Request]) -> list[TokenOutput | None]:
        """Sample `requests` in one engine call: each one's turn, or None where it stopped at the budget."""
        limits = {id(r): self._limit(r) for r in requests}
        batch = [r for r in requests if limits[id(r)] > 0]  # the others have no budget left in this phase
        done = self._sample(batch, [limits[id(r)] for r in batch]) if batch else {}
        return [done.get(id(r)) for r in requests]

    def _sample(self, batch: list[_Request], limits: list[int]) -> dict[int, TokenOutput | None]:
        dev = getattr(self.engine, "device", None)
        if isinstance(dev, torch.device) and dev.type == "cuda" and dev.index is not None:  # per thread
            torch.cuda.set_device(dev)
        self._release()
        prompts = [r.prompt_ids + r.tokens for r in batch]
        n = _group_size(prompts, limits, [self.handles.get(r.request_id) for r in batch])
        sp = replace(self.sampling, n=n, max_new_tokens_per_row=limits, keep_cache=True,
                     continuations=None if n > 1 else [self.handles.get(r.request_id) for r in batch],
                     seed=None if self.sampling.seed is None else self.sampling.seed + self.stats["num_generate_calls"])
        prompts = prompts[::n]
        t0 = time.perf_counter()
        out = self.engine.generate(prompts, sp)
        self.last_call_s = time.perf_counter() - t0
        self.stats["engine_s"] += self.last_call_s
        self.stats["num_generate_calls"] += 1
        stats = getattr(self.engine, "stats", {})
        self.stats["prefill_tokens_saved"] += int(stats.get("prefill_tokens_saved", 0))
        self.stats["prefill_tokens"] += int(stats.get("prefill_tokens", 0))
        done = {}
        for i, (r, limit) in enumerate(zip(batch, limits)):  # each row's new handle replaces the one the call consumed
            self.handles[r.request_id] = out.handles[i] if out.handles else None
            toks, reason = out.token_ids[i], out.finish_reason[i]
            r.version = self.weight_version if r.version is None else r.version
            r.tokens += toks
            r.logprobs += out.logprobs[i]
            self.used[r.request_id] = self.used.get(r.request_id, 0) + len(toks)
            parked = reason == "length" and len(toks) == limit and len(r.tokens) < r.max_new  # the budget stopped it
            done[id(r)] = None if parked else TokenOutput(list(r.tokens), list(r.logprobs), reason, r.version)
        return done


def _group_size(prompts: list[list[int]], limits: list[int], handles: list) -> int:
    """n when the batch is fresh requests in runs of n identical prompts with one budget (a GRPO group's first
    turn), else 1."""
    if any(h is not None for h in handles) or len(set(limits)) != 1:
        return 1
    n = 1
    while n < len(prompts) and prompts[n] == prompts[0]:
        n += 1
    if n == 1 or len(prompts) % n:
        return 1
    for s in range(0, len(prompts), n):
        if any(prompts[s + j] != prompts[s] for j in range(n)):
            return 1
    return n
