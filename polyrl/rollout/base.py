"""The rollout interface: what every text-generation backend promises the trainer.

A rollout engine turns prompt token ids into sampled continuations with per-token log-probs.
It knows nothing about rewards or RL. Backends register a builder by name (`actor_rollout_ref.rollout.name`):
`native` (ours), `hf` (transformers generate, the reference); `make_rollout` dispatches through that registry only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch


@dataclass
class SamplingParams:
    """How to sample one batch. `n` samples are drawn per prompt, stored prompt-major (p0s0, p0s1, ..., p1s0, ...)."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # EOS ids; generation stops after emitting one
    ignore_eos: bool = False
    seed: int | None = None
    # per-sequence forced lengths (benchmarks use these to model a long-tailed length distribution); a row that ends
    # at its forced length ends as at a stop token: with keep_unfinished only a forced length at the cap keeps a cache
    forced_lengths: list[int] | None = None
    # per-sequence caps (stop tokens still end a row earlier): partial rollouts continue rows with what is left
    max_new_tokens_per_row: list[int] | None = None
    # partial rollouts: rows stopped by their cap keep their KV cache for the next call (Generation.handles), and
    # `continuations[p]` (a handle or None, n=1) continues prompt p on that cache; engines without one ignore both
    keep_unfinished: bool = False
    continuations: list | None = None
    # MoE routing replay (R3): return Generation.routed_experts; engines that cannot record leave it None
    record_routes: bool = False
    # multi-turn (polyrl/agents): every row keeps its KV cache whatever ended it, a continuation's prompt may extend
    # the kept tokens (only the new ones are prefilled), and kept rows a call does not continue stay kept until
    # `release_kept` (or until the cache runs short)
    keep_cache: bool = False

    def row_limits(self, num_rows: int) -> list[int] | None:
        """Each row's exact (forced) or maximum new-token count, where set per row; None: `max_new_tokens` for all."""
        limits = self.forced_lengths if self.forced_lengths is not None else self.max_new_tokens_per_row
        if limits is not None and len(limits) != num_rows:
            raise ValueError(f"{'forced_lengths' if self.forced_lengths is not None else 'max_new_tokens_per_row'} "
                             f"has {len(limits)} entries; it needs one per sample ({num_rows}).")
        return limits

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Generation:
    """Result of `generate`: one row per sample (len(prompt_ids) * n rows, prompt-major).

    token_ids[i] are the generated ids only (no prompt), including the stop token if one was emitted.
    logprobs[i][t] is log p(token_ids[i][t]) under the *sampling* distribution's logits before temperature,
    i.e. the policy's log-prob of that token (temperature-scaled if temperature > 0; see backend docs).
    """

    prompt_index: list[int]  # which prompt each row came from
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reason: list[str]  # "stop" (emitted a stop token) or "length"
    handles: list | None = None  # with SamplingParams.keep_unfinished: per row, its kept KV cache (None: none kept)
    # MoE routing replay (R3): per row, int16 [len(prompt) + len(response), num_moe_layers, top_k], the expert ids each
    # layer chose at each position; -1 rows: not recorded (the last sampled token, never fed back). Recorded by the
    # native engine when built with `record_routes` and by the hf backend with SamplingParams.record_routes (both set
    # from rollout.enable_rollout_routing_replay). None: not recorded.
    routed_experts: list | None = None

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.token_ids]


def select_rows(out: Generation, rows, prompt_index: list[int]) -> Generation:
    """Rows `rows` of a generation (of any `Generation` subclass: every per-row list is cut the same way), with
    `prompt_index` as their prompts; everything else (metrics) is kept."""
    rows, num_rows = list(rows), len(out.prompt_index)
    cut = {}
    for f in dataclasses.fields(out):
        v = getattr(out, f.name)
        if f.name == "prompt_index":
            v = list(prompt_index)
        elif isinstance(v, list) and len(v) == num_rows:
            v = [v[j] for j in rows]
        cut[f.name] = v
    return type(out)(**cut)


class RolloutEngine(Protocol):
    """The narrow seam between the trainer and a generation backend."""

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> Generation: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights (HF parameter names) in place. Colocated: no copy beyond the engine's own layout."""
        ...

    def release_memory(self) -> None:
        """Free the KV cache (and optionally offload weights) while the trainer trains."""
        ...

    def resume(self) -> None:
        """Undo `release_memory` before the next `generate`."""
        ...


ROLLOUT_BACKENDS: dict[str, Callable[..., RolloutEngine]] = {}
"""name -> `build(cfg: RolloutConfig, model, *, pad_token_id, device, max_model_len) -> RolloutEngine`."""


def register_rollout(name: str):
    def deco(factory):
        ROLLOUT_BACKENDS[name] = factory
        return factory

    return deco
