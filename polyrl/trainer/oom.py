"""Out-of-memory errors in a training stage: free, shrink the cause, run the stage again; or stop with one sentence.

`OOMGuard.run(stage, fn)` runs one stage of the RL step (gen, old_log_prob, ref, update_actor). On a CUDA OOM it
1. lets go of the exception (its frames hold the stage's tensors), drops gradients and empties the allocator cache;
2. asks the stage's shrinker (`SHRINKERS`, one function per stage) to make the cause smaller: it edits the config key
   in place (so later steps start from the value that fit, and the warning names that key), e.g. halves a token
   budget, halves the engine's KV cache, or turns gradient checkpointing on (a training stage first lets go of a KV
   cache the engine kept through training, `rollout.free_cache_engine` auto-chosen False);
3. runs the stage again with the RNG states it started with: from its start, or, for an update, from the mini-batch
   that failed (`StageContext.progress`: the mini-batches before it have taken their optimizer steps).
A warning is printed once per key. A retry changes the result only as a different micro-batch split does: the
log-prob passes are pure, and a mini-batch restarts from zero gradients with normalisers fixed per mini-batch
(actor.py); the retried update's metrics cover the mini-batches it ran. An OOM under several processes (the other
ranks would wait in a collective) or with nothing left to shrink stops the run with `OutOfMemoryStop`: a `UserError`,
so the CLI prints one sentence naming the key and a value to set, and exits with status 2. Nothing here writes a
checkpoint, so those on disk stay as they were.

Test hook (no config key): POLYRL_INJECT_OOM, see utils/oom_hook.py.
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from polyrl.errors import UserError
from polyrl.utils.oom_hook import ACTIVE, is_oom, oom_point


class OutOfMemoryStop(UserError):
    """A stage does not fit in device memory even after shrinking; the message names the key to set."""


# ---------------------------------------------------------------------------------------------------- shrinkers
@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any


@dataclass
class StageContext:
    """What a shrinker may look at or shrink besides the config."""

    batch: dict | None = None  # the stage's batch: its longest sequence is the floor of a token budget
    micro_batch_size: int | None = None  # the row count used when no *_micro_batch_size_per_gpu is set
    engine: Any = None
    model: Any = None
    progress: Callable[[], int] | None = None  # units of the stage done for good (the update's applied mini-batches)
    done: int = 0  # `progress` when the last attempt failed: where the next one resumes

    def longest(self) -> int:
        return int(self.batch["attention_mask"].sum(1).max()) if self.batch is not None else 1


def _halve_budget(holder, prefix: str, dyn: str, budget: str, micro: str, ctx: StageContext) -> Change | None:
    """Halve the token budget (not below the longest sequence), or the rows per micro-batch (not below 1)."""
    if getattr(holder, dyn):
        old = getattr(holder, budget)
        new = max(ctx.longest(), old // 2)
    else:
        old = getattr(holder, micro) or ctx.micro_batch_size or 1
        new, budget = max(1, old // 2), micro
    if new >= old:
        return None
    setattr(holder, budget, new)
    return Change(prefix + budget, old, new)


def release_kept_cache(cfg, ctx: StageContext) -> Change | None:
    """An engine that kept its KV cache through training (rollout.free_cache_engine auto-chosen False) lets it go."""
    r = cfg.actor_rollout_ref.rollout
    if r.free_cache_engine or ctx.engine is None:
        return None
    ctx.engine.release_memory()
    r.free_cache_engine = True
    return Change("actor_rollout_ref.rollout.free_cache_engine", False, True)


def shrink_update(cfg, ctx: StageContext) -> Change | None:
    roles = cfg.actor_rollout_ref
    change = release_kept_cache(cfg, ctx) or _halve_budget(
        roles.actor, "actor_rollout_ref.actor.", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
        "ppo_micro_batch_size_per_gpu", ctx)
    if change is None and not roles.model.enable_gradient_checkpointing and ctx.model is not None:
        ctx.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        roles.model.enable_gradient_checkpointing = True
        change = Change("actor_rollout_ref.model.enable_gradient_checkpointing", False, True)
    return change


def shrink_old_log_prob(cfg, ctx: StageContext) -> Change | None:
    return release_kept_cache(cfg, ctx) or _halve_budget(
        cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout.", "log_prob_use_dynamic_bsz",
        "log_prob_max_token_len_per_gpu", "log_prob_micro_batch_size_per_gpu", ctx)


def shrink_ref(cfg, ctx: StageContext) -> Change | None:
    return release_kept_cache(cfg, ctx) or _halve_budget(
        cfg.actor_rollout_ref.ref, "actor_rollout_ref.ref.", "log_prob_use_dynamic_bsz",
        "log_prob_max_token_len_per_gpu", "log_prob_micro_batch_size_per_gpu", ctx)


def shrink_gen(cfg, ctx: StageContext) -> Change | None:
    """Native engine: half the KV blocks (never fewer than one prompt group at full length needs). HF engine: half
    the rows per generate() call (`rollout.max_num_seqs`)."""
    r, eng = cfg.actor_rollout_ref.rollout, ctx.engine
    if not hasattr(eng, "num_blocks"):
        old = eng.max_batch_size
        eng.max_batch_size = r.max_num_seqs = max(1, old // 2)
        return Change("actor_rollout_ref.rollout.max_num_seqs", old, eng.max_batch_size) if old > 1 else None
    eng.release_memory()  # the KV cache, graphs and block table go; resume() re-allocates at the new size
    need = r.n * eng.blocks.blocks_for(cfg.data.max_prompt_length + r.response_length) + 2
    old_blocks, new_blocks = eng.num_blocks, max(need, eng.num_blocks // 2)
    if new_blocks >= old_blocks:
        return None
    eng.num_blocks = new_blocks
    old = r.gpu_memory_utilization
    r.gpu_memory_utilization = round(_engine_utilization(eng, old, old_blocks), 3)
    return Change("actor_rollout_ref.rollout.gpu_memory_utilization", old, r.gpu_memory_utilization)


def _engine_utilization(eng, old_util: float, old_blocks: int) -> float:
    """The gpu_memory_utilization that gives the engine's new block count (weights + reserve + KV, over total)."""
    if not eng.cuda:
        return old_util * eng.num_blocks / old_blocks
    total = torch.cuda.get_device_properties(eng.device).total_memory
    reserve = eng.stats.get("activation_reserve_gib", 0.0) * 2**30
    return (eng.weight_bytes() + reserve + eng.num_blocks * eng.block_bytes) / total


SHRINKERS: dict[str, Callable[[Any, StageContext], Change | None]] = {
    "gen": shrink_gen, "old_log_prob": shrink_old_log_prob, "ref": shrink_ref, "update_actor": shrink_update,
}


def shorter_responses(cfg) -> str:
    """The LLM trainer's last resort: half the response length (every stage's memory grows with it)."""
    return f"data.max_response_length={max(1, cfg.data.max_response_length // 2)}"


def stop_sentence(stage: str, reason: str, change: Change | None, last_resort: str) -> str:
    """The one sentence a run ends with: what ran out, and the key and value to set."""
    fix = f"{change.key}={change.new}" if change is not None else f"{last_resort} (or use more GPUs)"
    return (f"The {stage} stage ran out of GPU memory {reason}; set {fix} and run again "
            "(trainer.resume_mode=auto continues from the last checkpoint).")


# ---------------------------------------------------------------------------------------------------- the guard
def _rng_states(generators, engine) -> list:
    gens = list(generators) + ([engine.generator] if isinstance(getattr(engine, "generator", None),
                                                                   torch.Generator) else [])
    calls = getattr(engine, "num_calls", None)
    return [(g, g.get_state()) for g in gens] + ([(engine, calls)] if calls is not None else [])


def _restore(states) -> None:
    for holder, state in states:
        if isinstance(holder, torch.Generator):
            holder.set_state(state)
        else:
            holder.num_calls = state  # the native engine seeds each generate() call from its call counter


class OOMGuard:
    """Runs stages with `shrinkers` (stage name -> shrinker; the LLM trainer's by default); `last_resort(cfg)` is the
    key=value a stop suggests when nothing is left to shrink."""

    def __init__(self, cfg, *, distributed: bool = False, optimizers=(), shrinkers=None, last_resort=shorter_responses,
                 log=None):
        self.cfg, self.distributed, self.optimizers = cfg, distributed, list(optimizers)
        self.shrinkers, self.last_resort = shrinkers or SHRINKERS, last_resort
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.warned: set[str] = set()
        self.num_retries = 0

    def free_memory(self) -> None:
        """Between stages gradients are dead weight (every update starts from zero_grad); then the cache."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def run(self, stage: str, fn: Callable[[], Any], *, ctx: StageContext | None = None, generators=()) -> Any:
        ctx = ctx or StageContext()
        states = _rng_states(generators, ctx.engine)
        attempt, last = 0, None
        while True:
            ACTIVE.update(stage=stage, attempt=attempt, point=0)
            failed = None
            try:
                oom_point()
                return fn()
            except (torch.OutOfMemoryError, RuntimeError) as e:
                if not is_oom(e):
                    raise
                failed = str(e).splitlines()[0][:200]  # keep a string: the exception pins the stage's tensors
            finally:
                ACTIVE.update(stage=None)
            if ctx.progress is not None:
                ctx.done = ctx.progress()
            self.free_memory()
            change = self.shrinkers[stage](self.cfg, ctx)
            if change is None:
                floor = f"even at {last.key}={last.new}" if last else "with nothing left to shrink"
                raise OutOfMemoryStop(stop_sentence(stage, floor, None, self.last_resort(self.cfg))) from None
            if self.distributed:
                raise OutOfMemoryStop(stop_sentence(stage, "on one of several processes, which cannot retry alone",
                                                    change, "")) from None
            if change.key not in self.warned:
                self.warned.add(change.key)
                self.log(f"polyrl: warning: {stage} ran out of GPU memory ({failed}); retrying with "
                         f"{change.key}={change.new} (was {change.old}); set it to avoid the retry.")
            _restore(states)
            self.num_retries += 1
            attempt, last = attempt + 1, change
