"""One-step off-policy GRPO/PPO: generation and training overlap on separate GPUs (verl's `one_step_off_policy`,
NeMo RL's async GRPO). Switched on by `actor_rollout_ref.hybrid_engine=False`; the default stays on-policy colocated.

One torch.distributed job: ranks [0, T) train (FSDP2 over them), ranks [T, T + R) generate, as data-parallel
replicas of `tensor_model_parallel_size` processes (trainer/rollout_pool.py; by default T = R = 1), on one host or
placed by Ray (job.py). Each role runs in a process group world of its own (`join`), so the trainer ranks are the
on-policy trainer's FSDP world and a replica's TP group the on-policy engine's; a job-wide `p2p.Link` carries batches
(gloo) and weights (NCCL on GPUs) between them. Batch k (trained at step k+1) is generated with the weights of step `v >= k - max_trajectory_age_steps`, so with the
default age 1, batch k+1 is decoded while step k trains:

    rollout:  gen b0 (v0) | gen b1 (v0)        | recv v1, gen b2 (v1) | recv v2, gen b3 (v2) ...
    trainer:              | train b0 -> v1     | train b1 -> v2       | train b2 -> v3 ...

Both roles are `PPOTrainer`s built from the same config: a rollout process (a one-process `DistEnv`) runs the
trainer's own `_collect_parts` (gen, reward, DAPO filtering) on its replica's share of the prompts and sends each
trainer rank the scored rows it trains; a trainer rank runs the unchanged `PPOTrainer.step()` with
`_collect_batch` assembling its batch from the replicas' pieces and the engine replaced by `RemoteRollout`, whose
`update_weights` streams the new weights rollout-ward a decoder layer at a time, each TP rank getting its slice
(p2p.py), under `timing_s/update_weights`, posted with isend so the trainer moves on. Age 0 is the synchronous
schedule, and then one trainer and one replica compute exactly what the on-policy trainer computes
(tests/test_async_ppo_on_cpu.py; pools: tests/test_offpolicy_pool_on_cpu.py).

Objective. The clipped PPO/GRPO loss takes as its "old" log-probs the *behaviour* policy's, the weights version
that generated the batch, so `pi_theta / pi_behaviour` is the true importance ratio of the sampled tokens and PPO's
clip is its truncation: plain PPO on data one step off-policy, with no truncation bias beyond the clip, and no second
copy of stale weights on the trainer. We chose it over decoupled PPO (old = the current weights, times a truncated
importance weight current/behaviour) because at an age of one step the exact ratio costs nothing. Where the
behaviour log-probs come from (`behaviour_source`):
- by default, **from the engine**: the log-probs it sampled with are the behaviour policy's, at the engine's precision.
  No pass anywhere. The engine-vs-trainer numerics gap (bf16: ~2e-4 in probability) enters the ratio, as on-policy
  it enters the samples; that is verl's bypass mode, which `rollout_correction.bypass_mode=True` also selects.
- with **decoupled rollout correction** on (`algorithm.rollout_correction.rollout_is` / `rollout_rs`, the FP8
  issue's TIS or rejection): recomputed by the trainer's own forward (full-precision weights) on the rollout process
  right after generation (`timing_s/behaviour_log_prob`), so the correction compares the engine with pi_old exactly
  as on-policy, at its unchanged call site in `PPOTrainer.step`.
The pass costs the rollout GPU time, and the rollout is the side the trainer waits for: on 2 H100s (1.5B, 32x8,
lognormal lengths) it took 1.1-1.4 s of the rollout's 6.5 s per batch. Hence the engine's by default; turn rollout
correction on where the gap is large (FP8 rollouts). Batches as fresh as the trained weights (the first, and all of
them at age 0) take the on-policy path (`old_from_current`): no pass, bit-identical results.

A reward in a process of its own (a reward model on GPUs of its own, the rule reward's Ray actor) scores batch k on
a thread while the rollout process generates batch k+1 (trainer/scoring_behind.py; `timing_s/reward_overlap`).

Partial rollouts (`async_training.partial_rollout=True`, trainer/partial_rollout.py): the rollout caps the tokens
a row decodes per generation call and continues unfinished rows in the next call, shipping the groups that finished;
their rows span weight versions, so pi_old is the engine's token by token and each sample is tagged with the first
version that generated it.

Multi-turn (`rollout.multi_turn.enable`): the rollout process's `_collect_parts` runs the agent loops
(polyrl/agents), as the on-policy trainer does, so the trainer's `_assemble_batch` gets the same generation (masks,
tool rewards, metrics); each assistant turn is tagged with the rollout's weights version (`_generating_version`) and
a row's version is its oldest turn's. With partial rollouts the trajectories live across calls (partial_rollout.py's
`AgentPartialRollouts`), so one trajectory's turns may carry several versions.

On a TP replica, what one rank must decide alone (the partial-rollout loop; the agent loops, through
`ReplicaRollout.run_led`) runs on the replica's leader inside `ReplicaRollout.lead()`, and its other ranks `follow()`
the leader's engine calls (rollout/native/tensor_parallel.py).

Metrics (besides the on-policy ones; docs/async_ppo.md):
- `timing_s/exposed_generation`: the trainer blocked waiting for the next batch (generation the overlap did not hide,
  the trainer's idle time waiting for data). `timing_s/rollout_idle`: the rollout process blocked waiting for weights.
- `timing_s/gen`, `timing_s/reward`, `timing_s/behaviour_log_prob`: the rollout process's stages for this batch; they
  overlap the step, so they are not part of `timing_s/step`.
- `timing_s/update_weights` (trainer: pack and post), `timing_s/rollout_update_weights` (rollout: receive and load).
- `async/weight_version/{min,max}` of the batch's samples and `async/staleness/{mean,max,min}` and
  `async/staleness/frac_<age>`: how many optimizer steps older than the trained weights each sample's weights were;
  multi-turn: `async/weight_version/turn_span/{mean,max}`, the spread of versions among a sample's turns.
- `perf/throughput` counts the GPUs of both roles.

Checkpoints are the trainer's (the rollout processes have no state of their own): every batch carries the
replicas' data position (sampler, each engine's RNG), mirrored into the trainer, so a checkpoint at step k resumes
generating batch k. A rollout process that dies makes the trainer ranks stop together, rank 0 with one sentence
saying so; rerunning resumes from the checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import os
import tempfile

import torch
import torch.distributed as dist

from polyrl.distributed import DistEnv
from polyrl.distributed import data as dp_data
from polyrl.distributed.env import build_mesh, use_expandable_segments
from polyrl.distributed.p2p import Link, WeightReceiver, WeightSender, bucket_plan, recv_object, send_object, \
    tensor_spec, wait_all
from polyrl.distributed.weights import full_tensors_by_layer, layer_key
from polyrl.errors import UserError
from polyrl.models.loader import merged_state_dict
from polyrl.rollout.base import Generation
from polyrl.trainer.async_config import partial_rollout_cap
from polyrl.trainer.oom import StageContext
from polyrl.trainer.partial_rollout import AgentPartialRollouts, PartialRollouts, continuation_sampling, row_metrics
from polyrl.trainer.ppo import PPOTrainer, resolve_defaults
from polyrl.trainer.rollout_batch import kept_rows
from polyrl.trainer.rollout_pool import Placement, deal_prompts, row_versions, select_prompts
from polyrl.trainer.scoring_behind import ScoringBehind, ScoringFailed
from polyrl.utils.timing import StepTimer

TRAINER_RANK = 0  # the trainer rank that greets the rollout processes (and logs, checkpoints)
PIPELINE_MIN_TIMEOUT_S = 3600


class RolloutProcessLost(UserError):
    """The rollout process stopped; the message says where to resume."""


def weight_versions_needed(total_steps: int, max_age: int) -> int:
    """The newest weights version any batch is generated with: batch k needs version >= k - max_age."""
    return max(0, total_steps - 1 - max_age)


def staleness_metrics(versions: list[int], trained_version: int, max_age: int,
                      turn_versions: list[list[int]] | None = None) -> dict[str, float]:
    """Each sample's age from its version (a multi-turn sample's oldest turn's); with `turn_versions` (per sample, per
    assistant turn) also the spread of versions within a sample."""
    ages = [trained_version - v for v in versions]
    out = {"async/staleness/mean": sum(ages) / len(ages), "async/staleness/max": float(max(ages)),
           "async/staleness/min": float(min(ages)), "async/weight_version/min": float(min(versions)),
           "async/weight_version/max": float(max(versions))}
    for age in range(max_age + 1):
        out[f"async/staleness/frac_{age}"] = ages.count(age) / len(ages)
    if turn_versions:
        spans = [max(t) - min(t) if t else 0 for t in turn_versions]
        out["async/weight_version/turn_span/mean"] = sum(spans) / len(spans)
        out["async/weight_version/turn_span/max"] = float(max(spans))
    return out


def behaviour_source(rc, *, stale: bool) -> str:
    """Where a batch's pi_old comes from (module docstring, Objective): `engine` (the log-probs the engine sampled
    with: a stale batch, or any in bypass mode), `current` (a fresh batch: the trainer's own forward, as on-policy) or
    `recomputed` (a stale batch under decoupled rollout correction, which compares the engine with pi_old at the
    trainer's precision: a forward on the rollout GPU)."""
    if rc.bypass_mode:
        return "engine"
    if not stale:
        return "current"
    return "recomputed" if rc.enabled else "engine"


def set_engine_state(engine, state: dict) -> None:
    """The inverse of `CheckpointingMixin._engine_generator_state`: put the engine's sampling RNG at `state`."""
    if state.get("generator") is not None and getattr(engine, "generator", None) is not None:
        engine.generator.set_state(state["generator"])
    if "num_calls" in state and hasattr(engine, "num_calls"):
        engine.num_calls = state["num_calls"]


def _bucket_bytes(cfg) -> int:
    return cfg.async_training.weight_bucket_mb * 2**20


def receiver_spec(named, cut=None) -> list[tuple[str, torch.Size, torch.dtype]]:
    """What a rollout process receives of each full tensor: the tensor, or `cut`'s slice of it (shapes only: the
    cut runs on meta tensors). The sender and the receiver both derive their bucket plan from this."""
    spec = tensor_spec(named)
    if cut is None:
        return spec
    return [(n, cut(n, torch.empty(shape, dtype=dt, device="meta")).shape, dt) for n, shape, dt in spec]


def weight_sender(model, place: Placement, trainer_rank: int, link: Link, bucket_bytes: int) -> WeightSender:
    """Trainer rank `trainer_rank`'s stream: every replica it owns (`Placement.owner`), each rank of it getting its
    TP slice, in buckets of a decoder layer at most. A one-process trainer feeding one replica lets a whole version
    travel while it trains on (a copy of its model); otherwise at most two buckets per receiver wait, so no trainer
    rank ever holds a copy of the model."""
    cuts = tensor_parallel_cuts(model, place.tp) if place.tp > 1 else [None]
    dests = [(r, cuts[(r - place.num_trainers) % place.tp]) for r in place.served_by(trainer_rank)]
    plan = bucket_plan(receiver_spec(merged_state_dict(model).items(), cuts[0]), bucket_bytes, split=layer_key)
    whole = place.num_trainers == 1 and len(dests) == 1
    return WeightSender(link.weights, dests, plan, None if whole else 2 * bucket_bytes * len(dests))


def weight_receiver(model, place: Placement, rank: int, link: Link, bucket_bytes: int, cut=None,
                    device: torch.device = torch.device("cpu")) -> WeightReceiver:
    """Rollout rank `rank`'s end of its owner's stream: the same plan from `model`'s names (full shapes, or `cut`'s
    slices for a TP rank)."""
    plan = bucket_plan(receiver_spec(merged_state_dict(model).items(), cut), bucket_bytes, split=layer_key)
    return WeightReceiver(link.weights, place.owner(place.replica_of(rank)), plan, device)


def tensor_parallel_cuts(model, tp: int) -> list:
    """For each rank of a TP-`tp` replica: (name, full HF tensor) -> its slice, as that rank's engine cuts it
    (rollout/native/tensor_parallel.py), computed on the trainer so a replica rank receives only its slice."""
    from polyrl.rollout.native.model import ModelSpec
    from polyrl.rollout.native.tensor_parallel import TensorParallel, TPGroup, local_spec

    full = ModelSpec.from_hf_config(model.config)
    return [TensorParallel(TPGroup(rank=r, size=tp), full, local_spec(full, tp)).local_tensor for r in range(tp)]


# ------------------------------------------------------------------------------------------------ trainer side
class RemoteRollout:
    """The trainer's engine: the real ones live in the rollout processes. `update_weights` streams the weights there
    (only versions some future batch needs); `generate` serves validation with a local `hf` engine over the actor's
    own weights. `states` mirror each replica's engine RNG position so checkpoints hold them."""

    def __init__(self, local, last_version: int):
        self.local, self.last_version = local, last_version
        self.sender: WeightSender | None = None  # set once the trainer's model exists
        self.version = 0  # the trainer's weights version: optimizer steps taken
        self.streaming = False  # set once the rollout processes have their start-up weights (before: resume's no-op)
        self.states: list[dict] = []  # each replica's engine RNG position, as its last batch left it

    def generate(self, prompt_ids, sampling):
        return self.local.generate(prompt_ids, sampling)

    def update_weights(self, named) -> None:
        if not self.streaming:
            return
        self.version += 1
        if self.version <= self.last_version:
            self.sender.send(named)

    def release_memory(self) -> None:
        pass

    def resume(self) -> None:
        pass


class _BuiltOnUse:
    """An object built by `build()` when one of its attributes is first read."""

    def __init__(self, build):
        self._build, self._built = build, None

    def __getattr__(self, name):
        if self._built is None:
            self._built = self._build()
        return getattr(self._built, name)


class _ReplicaFailed(Exception):
    """A rollout replica reported an exception of its own (its message is the sentence)."""


class AsyncPPOTrainer(PPOTrainer):
    """`PPOTrainer` (one of the trainer's FSDP ranks) whose batches come from the rollout replicas (module
    docstring)."""

    ROLE = "train"

    def __init__(self, cfg, dist_env: DistEnv, link: Link, place: Placement):
        self.link, self.place = link, place
        if cfg.actor_rollout_ref.rollout.free_cache_engine is None:  # no engine cache on this GPU to keep
            cfg.actor_rollout_ref.rollout.free_cache_engine = True
        super().__init__(cfg, dist=dist_env)
        self.max_age = cfg.async_training.max_trajectory_age_steps
        if cfg.async_training.partial_rollout and self.dist.is_rank0:  # the age limit holds per call (docs)
            spans = -(-cfg.actor_rollout_ref.rollout.response_length // partial_rollout_cap(cfg))
            print(f"polyrl: partial rollouts: a row may span up to {spans} generation calls, so trained rows can be "
                  f"older than async_training.max_trajectory_age_steps={self.max_age} (by about {spans - 1} weight "
                  f"version{'s' if spans > 2 else ''}; async/staleness/* logs it)")
        self.engine.sender = weight_sender(self.model, place, self.dist.rank, link, _bucket_bytes(cfg))
        self._start()

    def _make_engine(self):
        from polyrl.rollout.hf import HFRollout

        # validation on FSDP2 shards: the trainer ranks decode in step (rollout/hf.py)
        lockstep = self._max_over_ranks if self.dist.is_distributed else None
        local = HFRollout(self.model, pad_token_id=self.tokenizer.pad_token_id,
                          seed=self.cfg.actor_rollout_ref.rollout.seed, lockstep=lockstep)
        max_age = self.cfg.async_training.max_trajectory_age_steps
        return RemoteRollout(local, weight_versions_needed(self.total_steps, max_age))

    def _max_over_ranks(self, n: int) -> int:
        return int(self.dist.all_reduce(torch.tensor(n, device=self.device), "max"))

    def _weights_for_rollout(self):
        """Full tensors a decoder layer at a time (one all-gather per layer over the trainer ranks)."""
        return full_tensors_by_layer(merged_state_dict(self.model).items())

    def _engine_generator_state(self):
        return {"replicas": list(self.engine.states)}

    def load_extra_state(self, extra: dict) -> None:
        super().load_extra_state(extra)
        eng = extra.get("engine_generator") or {}
        if isinstance(eng, list):  # saved by several trainer ranks, which mirror the same states
            eng = eng[0] if eng else {}
        self.engine.states = list(eng.get("replicas", [eng] if eng else []))

    def _start(self) -> None:
        """Handshake: where to start (a resumed step, its data position, each replica's RNG) and the start-up
        weights."""
        self.engine.version = self.global_step
        place = self.place

        def greet():
            works = []
            if self.dist.rank == TRAINER_RANK:
                for r in range(place.num_trainers, place.world_size):
                    j = place.replica_of(r)
                    hello = {"global_step": self.global_step, "total_steps": self.total_steps,
                             "sampler": self.sampler.state_dict(),
                             "engine": self.engine.states[j] if j < len(self.engine.states) else {}}
                    works += send_object(hello, r, self.link.objects)
            wait_all(works)
            self.engine.sender.send(self._weights_for_rollout())

        self._agreed("at start-up", greet)
        self.engine.streaming = True

    def _collect_batch(self, timer):
        place, want = self.place, self.cfg.data.train_batch_size

        def receive():
            self.engine.sender.check()  # a weights send that failed since: the same stop, agreed here
            msgs = []
            for j in range(place.num_replicas):
                try:
                    msgs.append(recv_object(place.leader(j), self.link.objects))
                except RuntimeError as e:  # a dead peer's broken connection
                    raise _ReplicaFailed(self._lost(f"The rollout process (rank {place.leader(j)}) stopped before "
                                                    f"batch {self.global_step}")) from e
            for m in msgs:
                if "error" in m:
                    raise _ReplicaFailed(f"The rollout process failed generating batch {m['batch_index']}: "
                                         f"{m['error']}")
            return msgs

        with timer.stage("exposed_generation"):
            msgs = self._agreed(f"before batch {self.global_step}", receive)
        assert all(m["batch_index"] == self.global_step for m in msgs), ([m["batch_index"] for m in msgs],
                                                                          self.global_step)
        self.sampler.load_state_dict(msgs[0]["sampler"])  # the checkpoint's data position is the rollout's
        self.engine.states = [m["engine"] for m in msgs]
        parts = [p for m in msgs for p in m["parts"] if p["out"].prompt_index]  # a replica may have none for us
        metrics = dp_data.merge_step_metrics([{**m["metrics"], **m["timings"]} for m in msgs])
        samples, batch, index, metrics = self._assemble_batch(parts, want, metrics)
        rows = kept_rows(parts, want)
        behaviour = msgs[0]["behaviour"]
        assert all(m["behaviour"] == behaviour for m in msgs), [m["behaviour"] for m in msgs]
        if behaviour == "engine":  # the same tensor: ppo.step reads no engine-vs-trainer gap from it
            batch["old_log_probs"] = batch["rollout_log_probs"]
        elif behaviour == "recomputed":  # the generating weights' log-probs, computed on the rollout process
            old = torch.zeros(batch["rollout_log_probs"].shape, dtype=batch["rollout_log_probs"].dtype)
            for k, (i, j) in enumerate(rows):
                lp = parts[i]["old_log_probs"][j]
                old[k, :len(lp)] = torch.tensor(lp, dtype=old.dtype)
            batch["old_log_probs"] = old.to(self.device)
        versions = [parts[i]["versions"][j] for i, j in rows]
        turns = [parts[i]["out"].weight_versions[j] for i, j in rows] \
            if hasattr(parts[0]["out"], "weight_versions") else None  # multi-turn: each turn's own
        metrics.update(staleness_metrics(versions, self.global_step, self.max_age, turns))
        return samples, batch, index, metrics

    def _make_reward(self):
        """A reward model is built when validation first scores (the rollout process scores the training batches, so
        it loads here only if validation needs it); its directory and custom function are checked now."""
        from polyrl.rewards.model_reward import check_model_reward, resolve_reward_model

        setting = resolve_reward_model(self.cfg, self.dist.data.world_size)
        if setting is None:
            return super()._make_reward()
        check_model_reward(setting, self.cfg)
        return _BuiltOnUse(super()._make_reward)

    def _update_settings(self, batch, skip_mini_batches: int = 0):
        s = super()._update_settings(batch, skip_mini_batches)
        if "old_log_probs" in batch:  # a stale batch: its behaviour policy is not the current weights
            s = dataclasses.replace(s, old_from_current=False)
        return s

    def step(self) -> dict[str, float]:
        metrics = super().step()
        num_gpus = self.place.world_size  # the trainer's and the rollout processes'
        metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / (metrics["perf/time_per_step"] * num_gpus)
        return metrics

    def finish(self) -> None:
        """Wait for the last weights sent to arrive. No barrier with the rollout processes: they leave once their
        last batch is taken, and the final checkpoint / validation may take longer than any timeout they could wait
        with."""
        def last():
            self.engine.sender.wait()
            self.engine.sender.check()

        self._agreed("after the last step", last)

    def _agreed(self, when: str, fn):
        """`fn()`, where a rollout process that stopped (a RuntimeError from the link) or failed (its own sentence)
        stops every trainer rank at the same point: they agree first, so none is left waiting in a collective.
        Trainer rank 0 raises the sentence; the others leave quietly (exit status 2)."""
        problem, cause, out = None, None, None
        try:
            out = fn()
        except _ReplicaFailed as e:
            problem, cause = str(e), e
        except RuntimeError as e:
            problem, cause = self._lost(f"A rollout process stopped {when}"), e
        if self.dist.is_distributed:
            problem = next((p for p in self.dist.all_gather_object(problem) if p is not None), None)
        if problem is not None:
            if not self.dist.is_rank0:
                raise SystemExit(2)
            raise RolloutProcessLost(problem) from cause
        return out

    def _lost(self, what: str) -> str:
        return (f"{what} (see its own output above); rerun the same command to resume from the last checkpoint in "
                f"{self.cfg.trainer.default_local_dir} (trainer.save_freq sets how often one is written).")


# ------------------------------------------------------------------------------------------------ rollout side
class _RolloutRole(PPOTrainer):
    """A rollout process's engine, sampler and reward: a PPOTrainer that never updates, so its GPU's memory plan
    holds no optimizer state (more KV cache). `share`: which prompts of each drawn batch it generates (None: all)."""

    ROLE = "rollout"
    share: list[int] | None = None
    version = 0  # the weights version its engine holds (RolloutWorker._load_weights)

    def _prompt_share(self, prompts: list) -> list:
        return prompts if self.share is None else [prompts[i] for i in self.share]

    def _generating_version(self) -> int:
        return self.version


def scores_behind(cfg, reward) -> bool:
    """Whether the rollout process scores one batch behind its generation (trainer/scoring_behind.py): the reward
    runs in a process of its own, and no stage needs a batch's scores, or the rollout GPU, before the next
    generation (DAPO's group filter and remax's baseline decide what to generate next; decoupled rollout correction
    and partial rollouts are serial here for now)."""
    from polyrl.rewards.model_reward import RemoteModelReward
    from polyrl.rewards.remote import RemoteReward
    from polyrl.trainer.async_config import scoring_may_trail

    return isinstance(reward, (RemoteModelReward, RemoteReward)) and scoring_may_trail(cfg)



class RolloutWorker:
    """A rollout process: generates and scores batch after batch with the newest weights the age limit allows
    (evaluating stale batches' behaviour log-probs where decoupled rollout correction asks for them), and sends each
    trainer rank its rows. Every rank of a tensor-parallel replica runs this loop (the engine's collectives keep them
    in step); only the replica's leader brings prompts, scores and sends. A reward in a process of its own scores one
    batch behind the generation (trainer/scoring_behind.py; one trainer and one replica only)."""

    def __init__(self, cfg, dist_env: DistEnv, link: Link, place: Placement, rank: int):
        cfg = copy.deepcopy(cfg)
        resolve_defaults(cfg)
        # no reference model, critic, logs or resumed state here: the trainer owns those, and sends the start position
        cfg.actor_rollout_ref.actor.use_kl_loss = False
        cfg.algorithm.use_kl_in_reward = False
        cfg.critic.enable = False
        cfg.trainer.resume_mode = "disable"
        cfg.trainer.logger = []
        cfg.actor_rollout_ref.rollout.free_cache_engine = False  # the GPU is the engine's: keep the KV cache
        # LoRA: the trainer streams merged weights under HF's names, so this side holds the plain model (fresh
        # adapters merge to the base, so both start equal)
        cfg.actor_rollout_ref.model.lora_rank = 0
        self.link, self.place, self.replica = link, place, place.replica_of(rank)
        self.leader = rank == place.leader(self.replica)
        cfg.actor_rollout_ref.rollout.seed += self.replica  # each replica samples its own stream
        # its config/env files beside the trainer's run when that is named, else in a scratch folder (the trainer's
        # timestamped run directory is only chosen in the trainer process)
        name = "rollout" if place.num_rollout == 1 else f"rollout{rank - place.num_trainers}"
        cfg.trainer.run_dir = os.path.join(cfg.trainer.run_dir or tempfile.mkdtemp(prefix="polyrl-"), name)
        self.max_age = cfg.async_training.max_trajectory_age_steps
        self.roll = _RolloutRole(cfg, dist=dist_env)
        self.routes = None  # the whole batch to trainer rank 0 (1 trainer, 1 replica: DAPO's parts too)
        if (place.num_trainers, place.num_replicas) != (1, 1):
            deal = deal_prompts(cfg.data.train_batch_size, cfg.actor_rollout_ref.actor.ppo_mini_batch_size,
                                place.num_trainers, place.num_replicas)[self.replica]
            mine = [p for per_trainer in deal for p in per_trainer]
            if cfg.async_training.partial_rollout:  # one replica: its finished groups are the whole batch, in order
                mine = list(range(cfg.data.train_batch_size))
            else:
                self.roll.share = mine
            where = {p: i for i, p in enumerate(mine)}
            self.routes = [[where[p] for p in per_trainer] for per_trainer in deal]
        if not self.leader:  # a TP replica's other ranks bring no prompts of their own (ReplicaRollout)
            self.roll.share = []
        self.timer = StepTimer()
        self.sliced = place.tp > 1  # receives its TP slices straight into the engine
        cut = self.roll.engine.shards.local_tensor if self.sliced else None
        self.receiver = weight_receiver(self.roll.model, place, rank, link, _bucket_bytes(cfg), cut, self.roll.device)
        self.version = 0
        r = cfg.actor_rollout_ref.rollout
        self.partial = None
        if cfg.async_training.partial_rollout and self.roll.agents is not None:  # multi-turn: trajectories in flight
            self.partial = AgentPartialRollouts(self.roll.agents.start(self.roll.engine, self.roll._sampling_params(),
                                                                       partial_rollout_cap(cfg)))
        elif cfg.async_training.partial_rollout:
            self.partial = PartialRollouts(r.n, r.response_length, partial_rollout_cap(cfg))
        self.behind = None
        if scores_behind(cfg, self.roll.reward):  # one trainer and one rollout process (async_config.check_placement)
            self.behind = ScoringBehind(self.roll, self._deliver, self._fail)
        self.pending: list = []  # the works of the last batch sent (to every trainer rank)

    def serve(self) -> None:
        hello = recv_object(TRAINER_RANK, self.link.objects)
        start, total = hello["global_step"], hello["total_steps"]
        self.roll.sampler.load_state_dict(hello["sampler"])
        set_engine_state(self.roll.engine, hello["engine"])
        self._load_weights(start)
        for k in range(start, total):
            with self.timer.stage("rollout_idle"):
                while self.version < k - self.max_age:
                    self._load_weights(self.version + 1)
            self.roll.global_step = k  # names rollout_data_dir dumps after the step that trains this batch
            try:
                if self.behind is not None:
                    self.behind.generate(k, self.timer, self.version)
                else:
                    self._deliver(k, *self._collect())
            except ScoringFailed:  # the thread has told the trainer
                raise
            except Exception as e:  # the trainer stops with this sentence instead of a broken-pipe error
                if self.behind is not None:
                    self.behind.close()  # the batches before this one go first (or their failure is the news)
                self._fail(k, f"{type(e).__name__}: {e}")
                raise
        if self.behind is not None:
            self.behind.close()
        if self.partial is not None:  # lets the kept caches go: on a TP replica every rank does (rank 0 decides)
            if self.sliced and not self.leader:
                self.roll.engine.follow()
            else:
                with self.roll.engine.lead() if self.sliced else contextlib.nullcontext():
                    self.partial.close()
        self._wait_sent()  # the trainer has taken the last batch: nothing more to do here

    def _collect(self) -> tuple[list[dict], dict, dict, dict]:
        """Batch k generated and scored here: its parts (each row tagged with the weights version that generated
        it), metrics, timings and the data position a resume starts generating from (before the oldest prompts still
        in flight, if any)."""
        roll = self.roll
        if self.partial is not None:
            parts, metrics = self._partial_parts()
        else:
            parts, metrics = roll._collect_parts(self.timer)
            for p in parts:
                p["versions"] = row_versions(p["out"], self.version)
        position = {"sampler": (self.partial and self.partial.resume_state()) or roll.sampler.state_dict(),
                    "engine": roll._engine_generator_state()}
        return parts, metrics, self.timer.pop(), position

    def _deliver(self, k: int, parts: list[dict], metrics: dict, timings: dict, position: dict) -> None:
        """Send batch k to the trainer ranks, each its rows (`routes`) with what they all get alike: where pi_old
        comes from, timings, the data position. Only a replica's leader sends (a TP replica's other ranks' rows are
        its); the previous batch has long arrived: at most one in flight. Called by the scoring thread too."""
        if not self.leader:
            return
        roll = self.roll
        versions = [v for p in parts for v in p["versions"]]
        behaviour = behaviour_source(roll.cfg.algorithm.rollout_correction, stale=min(versions) < k)
        if behaviour == "recomputed":  # the generating weights' log-probs at the trainer's precision
            assert self.behind is None  # scores_behind: never with decoupled correction
            with self.timer.stage("behaviour_log_prob"):
                self._behaviour_log_probs(parts, roll.cfg.data.train_batch_size)
            timings = {**timings, **self.timer.pop()}
        timings.setdefault("timing_s/rollout_update_weights", 0.0)
        if self.routes is None:
            pieces = [parts]
        else:
            (part,) = parts
            pieces = [[select_prompts(part, route)] for route in self.routes]
        common = {"batch_index": k, "metrics": metrics, "timings": timings, "behaviour": behaviour,
                  "engine": position["engine"], "sampler": position["sampler"]}
        self._wait_sent()
        self.pending = [w for t, piece in enumerate(pieces)
                        for w in send_object({**common, "parts": piece}, t, self.link.objects)]

    def _fail(self, k: int, error: str) -> None:
        """Tell every trainer rank that batch k failed (the leader does)."""
        if not self.leader:
            return
        self._wait_sent()
        for t in range(self.place.num_trainers):
            wait_all(send_object({"batch_index": k, "error": error}, t, self.link.objects))

    def _wait_sent(self) -> None:
        wait_all(self.pending)
        self.pending = []

    def _behaviour_log_probs(self, parts: list[dict], want: int) -> None:
        """Each kept row's pi_old (the trainer's forward under the weights that generated it), as per-row lists in
        `part["old_log_probs"]`: the trainer rebuilds its batch's tensor from them."""
        roll = self.roll
        _, batch, _, _ = roll._assemble_batch(parts, want, {})
        old = roll._old_logprobs(roll.model, batch, roll._update_settings(batch)).cpu()
        for p in parts:
            p["old_log_probs"] = [[] for _ in p["out"].prompt_index]
        for k, (i, j) in enumerate(kept_rows(parts, want)):
            parts[i]["old_log_probs"][j] = old[k, :len(parts[i]["out"].logprobs[j])].tolist()

    def _partial_parts(self) -> tuple[list[dict], dict]:
        """Partial rollouts (trainer/partial_rollout.py): draw a batch of prompts, decode every row in flight up to
        the cap, and repeat until enough groups have finished; ship the oldest finished ones."""
        roll, pool, timer = self.roll, self.partial, self.timer
        want, sampling = roll.cfg.data.train_batch_size, roll._sampling_params()
        agents = isinstance(pool, AgentPartialRollouts)
        if self.sliced and not self.leader:  # a TP replica's rank 0 decides every call; this rank makes them too
            with timer.stage("gen"):
                roll.engine.follow()
            return [roll._scored_part([], Generation([], [], [], []), timer, {})], {}
        calls = on_cache = 0
        with roll.engine.lead() if self.sliced else contextlib.nullcontext():
            while not calls or pool.num_done() < want:
                state = copy.deepcopy(roll.sampler.state_dict())
                pool.add(roll.sampler.next_batch(), state)
                if agents:  # the trajectories' turns up to the cap, tools between them (no OOM retry: not repeatable)
                    with timer.stage("gen"):
                        roll.engine.resume()
                        on_cache += pool.run(self.version)
                else:
                    prompts, rows, caps = pool.requests()
                    with timer.stage("gen"):
                        out = roll.oom.run("gen", lambda: roll._generate(prompts,
                                                                         continuation_sampling(sampling, rows, caps)),
                                           ctx=StageContext(engine=roll.engine))
                    pool.absorb(out, rows, caps, self.version)
                    on_cache += getattr(roll.engine, "stats", {}).get("num_resumed", 0)
                calls += 1
        groups = pool.take(want)
        prompts, out = pool.part(groups)
        continued = "turns_continued" if agents else "rows_continued_on_kept_cache"
        metrics = {**getattr(out, "metrics", {}), **row_metrics(groups),
                   "async/partial_rollout/gen_calls": float(calls), f"async/partial_rollout/{continued}": float(on_cache),
                   "async/partial_rollout/groups_in_flight": float(len(pool.groups))}
        part = roll._scored_part(prompts, out, timer, metrics)
        part["versions"] = [r.first_version for g in groups for r in g.rows]
        return [part], metrics

    @torch.no_grad()
    def _load_weights(self, version: int) -> None:
        """Receive weights `version`: a TP rank's slices straight into its engine; a whole replica's into the
        full-precision model (behaviour log-probs read it), then into the engine's own copy (if separate)."""
        with self.timer.stage("rollout_update_weights"):
            if self.sliced:
                self.roll.engine.update_weights(self.receiver.receive(), sliced=True)
            else:
                params = merged_state_dict(self.roll.model)
                for name, t in self.receiver.receive():
                    params[name].copy_(t)
                self.roll.engine.update_weights(self.roll._weights_for_rollout())
        self.version = self.roll.version = version


# ------------------------------------------------------------------------------------------------ the job
def join_job(cfg) -> tuple[int, DistEnv, Link, Placement]:
    """Join the job torchrun (or a test) started as `cfg` places it; see `join`."""
    place = Placement.of(cfg)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world != place.world_size:
        raise UserError(f"actor_rollout_ref.hybrid_engine=False runs as {place.world_size} processes "
                        f"({place.num_trainers} trainer, {place.num_rollout} rollout) but this job has {world}; start "
                        f"it with `polyrl train` (it launches them) or torchrun --nproc_per_node={place.world_size}.")
    # a wait here can last a whole step (and a validation): at least an hour
    timeout_s = max(cfg.actor_rollout_ref.nccl_timeout, PIPELINE_MIN_TIMEOUT_S)
    env, link = join(place, rank, device=cfg.trainer.device,
                     fsdp_size=cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size, timeout_s=timeout_s)
    return rank, env, link, place


def join(place: Placement, rank: int, *, device: str, fsdp_size: int, timeout_s: float) -> tuple[DistEnv, Link]:
    """This process's `DistEnv` (the trainer's FSDP world; a one-process view for a rollout process, whose
    replica's TP group lives in the rollout world) and the job-wide `Link`. Each role's world is a process group of
    its own on the job's rendezvous store (env://: torchrun's, or MASTER_ADDR/MASTER_PORT)."""
    world = place.world_size
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        use_expandable_segments()
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    trains = place.is_trainer(rank)
    role_rank, role_world = (rank, place.num_trainers) if trains else (rank - place.num_trainers, place.num_rollout)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                            store=dist.PrefixStore("polyrl/train/" if trains else "polyrl/rollout/", store),
                            rank=role_rank, world_size=role_world, timeout=timeout,
                            device_id=dev if cuda else None)
    link = Link(store, rank, world, timeout, cuda)
    if trains and role_world > 1:  # FSDP2 over the trainer's world, as the on-policy trainer's DistEnv.setup
        env = DistEnv(rank=rank, world_size=role_world, local_rank=local, device=dev,
                      mesh=build_mesh(dev.type, role_world, fsdp_size))
    else:  # rank 0 of a world of its own: seeds, samples and reduces as one on-policy process would
        env = DistEnv(rank=0, world_size=1, local_rank=local, device=dev)
    return env, link


def train_async(cfg) -> AsyncPPOTrainer | None:
    """Run this process's role to the end; the trainer is returned on trainer ranks, None on rollout processes."""
    rank, env, link, place = join_job(cfg)
    try:
        if place.is_trainer(rank):
            trainer = AsyncPPOTrainer(cfg, env, link, place)
            trainer.fit()
            trainer.finish()
            env.barrier()  # rank 0 may still be writing files after the last collective
            return trainer
        RolloutWorker(cfg, env, link, place, rank).serve()
        return None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
