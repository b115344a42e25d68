"""The engine as the agent loops' `server_manager`: every trajectory is its own request, and the turns that are ready
together are sampled together.

`generate(request_id, prompt_ids, ...)` parks the request; a pump batches the parked requests into one
`engine.generate` call (in one engine thread, so tools keep running meanwhile) once every live trajectory is waiting
for the engine, or `coalesce_s` after the first one arrived (trajectories whose tools are slow do not hold the others
back: they join a later call). A request's KV cache is kept between its turns (`SamplingParams.keep_cache`, the
native engine's `KeptRow`), so a turn prefills only the tokens that are new since the last one: the tool turn, plus
the last sampled token whose K/V was not written yet. `stats['prefill_tokens_saved']` counts the rest. Fresh requests
that share a prompt (the GRPO group of the first turn) go in as one prompt with n samples, so the prompt is prefilled
once. Backends without kept caches (hf) re-prefill every turn; the tokens are the same.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from polyrl.agents.base import TokenOutput
from polyrl.rollout.base import SamplingParams


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    max_new: int
    future: asyncio.Future


class EngineServer:
    def __init__(self, engine, sampling: SamplingParams, weight_version: int = 0, coalesce_s: float = 0.02):
        self.engine, self.sampling, self.weight_version, self.coalesce_s = engine, sampling, weight_version, coalesce_s
        self.pending: list[_Request] = []
        self.handles: dict[str, object] = {}  # request id -> the engine's kept cache of its last turn
        self.released: list = []
        self.num_live = 0  # trajectories still running (set by the runner)
        self.stats = {"prefill_tokens_saved": 0, "prefill_tokens": 0, "num_generate_calls": 0, "engine_s": 0.0}
        self._wake: asyncio.Event | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="polyrl-engine")

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict | None = None,
                       max_new_tokens: int | None = None, **_) -> TokenOutput:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(_Request(request_id, list(prompt_ids), max_new_tokens or self.sampling.max_new_tokens, fut))
        self._kick()
        return await fut

    def finish(self, request_id: str) -> None:
        """A trajectory ended: its kept cache is let go before the next engine call."""
        h = self.handles.pop(request_id, None)
        if h is not None:
            self.released.append(h)
        self._kick()

    def _kick(self):
        if self._wake is not None:
            self._wake.set()

    async def pump(self) -> None:
        """Serve requests until no trajectory is live."""
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        while self.num_live > 0 or self.pending:
            if not self.pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            deadline = loop.time() + self.coalesce_s
            while len(self.pending) < self.num_live and loop.time() < deadline:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
            batch, self.pending = self.pending, []
            try:
                outs = await loop.run_in_executor(self._thread, self._generate, batch)
            except Exception as e:  # an engine failure ends every waiting trajectory with it (the trainer sees it)
                for r in batch:
                    r.future.set_exception(e)
                continue
            for r, o in zip(batch, outs):
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

    def _generate(self, batch: list[_Request]) -> list[TokenOutput]:
        dev = getattr(self.engine, "device", None)
        if isinstance(dev, torch.device) and dev.type == "cuda" and dev.index is not None:  # per thread
            torch.cuda.set_device(dev)
        self._release()
        n = _group_size(batch, self.handles)
        prompts = [r.prompt_ids for r in batch][::n]
        sp = replace(self.sampling, n=n, max_new_tokens_per_row=[r.max_new for r in batch], keep_cache=True,
                     continuations=None if n > 1 else [self.handles.get(r.request_id) for r in batch],
                     seed=None if self.sampling.seed is None else self.sampling.seed + self.stats["num_generate_calls"])
        t0 = time.perf_counter()
        out = self.engine.generate(prompts, sp)
        self.stats["engine_s"] += time.perf_counter() - t0
        self.stats["num_generate_calls"] += 1
        stats = getattr(self.engine, "stats", {})
        self.stats["prefill_tokens_saved"] += int(stats.get("prefill_tokens_saved", 0))
        self.stats["prefill_tokens"] += int(stats.get("prefill_tokens", 0))
        for i, r in enumerate(batch):  # each row's new handle replaces its old one (which the call consumed)
            self.handles[r.request_id] = out.handles[i] if out.handles else None
        return [TokenOutput(list(t), list(lp), fr, self.weight_version)
                for t, lp, fr in zip(out.token_ids, out.logprobs, out.finish_reason)]


def _group_size(batch: list[_Request], handles: dict) -> int:
    """n when the batch is fresh requests in runs of n identical prompts with one budget (a GRPO group's first
    turn), else 1."""
    if any(handles.get(r.request_id) is not None for r in batch) or len({r.max_new for r in batch}) != 1:
        return 1
    n = 1
    while n < len(batch) and batch[n].prompt_ids == batch[0].prompt_ids:
        n += 1
    if n == 1 or len(batch) % n:
        return 1
    for s in range(0, len(batch), n):
        if any(batch[s + j].prompt_ids != batch[s].prompt_ids for j in range(n)):
            return 1
    return n
