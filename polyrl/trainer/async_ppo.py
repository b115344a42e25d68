"""One-step off-policy GRPO/PPO: generation and training overlap on separate GPUs (verl's `one_step_off_policy`,
NeMo RL's async GRPO). Switched on by `actor_rollout_ref.hybrid_engine=False`; the default stays on-policy colocated.

One torch.distributed job of two processes (gloo on CPU; on GPUs `cpu:gloo,cuda:nccl`): rank 0 trains, rank 1
generates, on one host or on two (Ray places one process per node where this host lacks a second GPU: job.py).
Batch k (trained at step k+1) is generated with the weights of step `v >= k - max_trajectory_age_steps`, so with the
default age 1, batch k+1 is decoded while step k trains:

    rollout:  gen b0 (v0) | gen b1 (v0)        | recv v1, gen b2 (v1) | recv v2, gen b3 (v2) ...
    trainer:              | train b0 -> v1     | train b1 -> v2       | train b2 -> v3 ...

Both roles are `PPOTrainer`s built from the same config, each with a one-process `DistEnv` of its own: the rollout
process runs the trainer's own `_collect_batch` (gen, reward, DAPO filtering) and sends the finished batch; the
trainer process runs the unchanged `PPOTrainer.step()` with `_collect_batch` receiving that batch and the engine
replaced by `RemoteRollout`, whose `update_weights` streams the new weights rollout-ward in buckets (p2p.py) under
`timing_s/update_weights`, posted with isend so the trainer moves on at once. Age 0 is the synchronous schedule,
and then the trainer computes exactly what the on-policy trainer computes (tests/test_async_ppo_on_cpu.py).

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

Metrics (besides the on-policy ones; docs/async_ppo.md):
- `timing_s/exposed_generation`: the trainer blocked waiting for the next batch (generation the overlap did not hide,
  the trainer's idle time waiting for data). `timing_s/rollout_idle`: the rollout process blocked waiting for weights.
- `timing_s/gen`, `timing_s/reward`, `timing_s/behaviour_log_prob`: the rollout process's stages for this batch; they
  overlap the step, so they are not part of `timing_s/step`.
- `timing_s/update_weights` (trainer: pack and post), `timing_s/rollout_update_weights` (rollout: receive and load).
- `async/weight_version/{min,max}` of the batch's samples and `async/staleness/{mean,max,min}` and
  `async/staleness/frac_<age>`: how many optimizer steps older than the trained weights each sample's weights were.
- `perf/throughput` counts the GPUs of both roles.

Checkpoints are the trainer's (the rollout process has no state of its own): every batch carries the rollout's data
position (sampler, engine RNG), mirrored into the trainer, so a checkpoint at step k resumes generating batch k. A
rollout process that dies makes the trainer stop with one sentence saying so; rerunning resumes from the checkpoint.
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
from polyrl.distributed.env import use_expandable_segments
from polyrl.distributed.p2p import WeightReceiver, WeightSender, object_link, recv_object, send_object, tensor_spec
from polyrl.errors import UserError
from polyrl.models.loader import merged_state_dict
from polyrl.trainer.async_config import partial_rollout_cap
from polyrl.trainer.oom import StageContext
from polyrl.trainer.partial_rollout import PartialRollouts, as_part, continuation_sampling, row_metrics
from polyrl.trainer.ppo import PPOTrainer, resolve_defaults
from polyrl.trainer.scoring_behind import ScoringBehind, ScoringFailed
from polyrl.utils.timing import StepTimer

TRAINER_RANK, ROLLOUT_RANK = 0, 1
PIPELINE_MIN_TIMEOUT_S = 3600


class RolloutProcessLost(UserError):
    """The rollout process stopped; the message says where to resume."""


def weight_versions_needed(total_steps: int, max_age: int) -> int:
    """The newest weights version any batch is generated with: batch k needs version >= k - max_age."""
    return max(0, total_steps - 1 - max_age)


def staleness_metrics(versions: list[int], trained_version: int, max_age: int) -> dict[str, float]:
    ages = [trained_version - v for v in versions]
    out = {"async/staleness/mean": sum(ages) / len(ages), "async/staleness/max": float(max(ages)),
           "async/staleness/min": float(min(ages)), "async/weight_version/min": float(min(versions)),
           "async/weight_version/max": float(max(versions))}
    for age in range(max_age + 1):
        out[f"async/staleness/frac_{age}"] = ages.count(age) / len(ages)
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


# ------------------------------------------------------------------------------------------------ trainer side
class RemoteRollout:
    """The trainer's engine: the real one lives in the rollout process. `update_weights` streams the weights there
    (only versions some future batch needs); `generate` serves validation with a local `hf` engine over the actor's
    own weights. `generator` / `num_calls` mirror the rollout engine's RNG position so checkpoints hold it."""

    def __init__(self, local, sender: WeightSender, last_version: int, *, remote_has_generator: bool):
        self.local, self.sender, self.last_version = local, sender, last_version
        self.version = 0  # the trainer's weights version: optimizer steps taken
        self.streaming = False  # set once the rollout process has its start-up weights (before: resume's no-op)
        self.generator = _MirroredGenerator() if remote_has_generator else None
        self.num_calls = 0

    def mirror(self, state: dict) -> None:
        if "generator" in state:
            self.generator.set_state(state["generator"])
        else:
            self.num_calls = state["num_calls"]

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


class _MirroredGenerator:
    """Holds the rollout engine's generator state as it arrives (it may be a CUDA generator's: kept opaque)."""

    def __init__(self):
        self.state = None

    def get_state(self):
        return self.state

    def set_state(self, state) -> None:
        self.state = state


class AsyncPPOTrainer(PPOTrainer):
    """`PPOTrainer` whose batches come from the rollout process (module docstring)."""

    ROLE = "train"

    def __init__(self, cfg, dist_env: DistEnv):
        self._link = object_link()  # both roles' first call, so the groups pair up
        self._sender = WeightSender(ROLLOUT_RANK, _bucket_bytes(cfg))
        if cfg.actor_rollout_ref.rollout.free_cache_engine is None:  # no engine cache on this GPU to keep
            cfg.actor_rollout_ref.rollout.free_cache_engine = True
        super().__init__(cfg, dist=dist_env)
        self.max_age = cfg.async_training.max_trajectory_age_steps
        if cfg.async_training.partial_rollout:  # the age limit holds per call; a row spanning calls is older (docs)
            spans = -(-cfg.actor_rollout_ref.rollout.response_length // partial_rollout_cap(cfg))
            print(f"polyrl: partial rollouts: a row may span up to {spans} generation calls, so trained rows can be "
                  f"older than async_training.max_trajectory_age_steps={self.max_age} (by about {spans - 1} weight "
                  f"version{'s' if spans > 2 else ''}; async/staleness/* logs it)")
        self._start()

    def _make_engine(self):
        from polyrl.rollout.hf import HFRollout

        local = HFRollout(self.model, pad_token_id=self.tokenizer.pad_token_id,
                          seed=self.cfg.actor_rollout_ref.rollout.seed)
        max_age = self.cfg.async_training.max_trajectory_age_steps
        return RemoteRollout(local, self._sender, weight_versions_needed(self.total_steps, max_age),
                             remote_has_generator=self.cfg.actor_rollout_ref.rollout.name == "hf")

    def _start(self) -> None:
        """Handshake: where to start (a resumed step, its data position) and the start-up weights."""
        self.engine.version = self.global_step
        hello = {"global_step": self.global_step, "total_steps": self.total_steps,
                 "sampler": self.sampler.state_dict(), "engine": self._engine_generator_state()}
        with self._lost_guard("at start-up"):
            for w in send_object(hello, ROLLOUT_RANK, self._link):
                w.wait()
            self._sender.send(self._weights_for_rollout())
        self.engine.streaming = True

    def _collect_batch(self, timer):
        with timer.stage("exposed_generation"), self._lost_guard(f"before batch {self.global_step}"):
            msg = recv_object(ROLLOUT_RANK, self._link)
        if "error" in msg:
            raise RolloutProcessLost(f"The rollout process failed generating batch {msg['batch_index']}: "
                                     f"{msg['error']}")
        assert msg["batch_index"] == self.global_step, (msg["batch_index"], self.global_step)
        self.sampler.load_state_dict(msg["sampler"])  # the checkpoint's data position is the rollout's
        self.engine.mirror(msg["engine"])
        batch = {k: v.to(self.device) for k, v in msg["batch"].items()}
        if msg["behaviour"] == "engine":  # the same tensor: ppo.step reads no engine-vs-trainer gap from it
            batch["old_log_probs"] = batch["rollout_log_probs"]
        metrics = {**msg["metrics"], **msg["timings"],
                   **staleness_metrics(msg["weight_versions"], self.global_step, self.max_age)}
        return msg["samples"], batch, msg["index"], metrics

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
        num_gpus = 2  # the trainer's and the rollout process's
        metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / (metrics["perf/time_per_step"] * num_gpus)
        return metrics

    def finish(self) -> None:
        """Wait for the last weights sent to arrive. No barrier: the rollout process leaves once its last batch is
        taken, and the final checkpoint / validation may take longer than any timeout it could wait with."""
        with self._lost_guard("after the last step"):
            self._sender.wait()

    def _lost_guard(self, when: str):
        return _rollout_lost(f"The rollout process (rank {ROLLOUT_RANK}) stopped {when} (see its own output above)",
                             self.cfg.trainer.default_local_dir)


@contextlib.contextmanager
def _rollout_lost(what: str, ckpt_dir: str):
    """A dead peer's broken connection (a RuntimeError from gloo) becomes `RolloutProcessLost`: where to resume."""
    try:
        yield
    except RuntimeError as e:
        raise RolloutProcessLost(f"{what}; rerun the same command to resume from the last checkpoint in {ckpt_dir} "
                                 "(trainer.save_freq sets how often one is written).") from e


# ------------------------------------------------------------------------------------------------ rollout side
class _RolloutRole(PPOTrainer):
    """The rollout process's engine, sampler and reward: a PPOTrainer that never updates, so its GPU's memory plan
    holds no optimizer state (more KV cache)."""

    ROLE = "rollout"


def scores_behind(cfg, reward) -> bool:
    """Whether the rollout process scores one batch behind its generation (trainer/scoring_behind.py): the reward
    runs in a process of its own, and no stage needs a batch's scores, or the rollout GPU, before the next
    generation (DAPO's group filter and remax's baseline decide what to generate next; decoupled rollout correction
    and partial rollouts are serial here for now)."""
    from polyrl.rewards.model_reward import RemoteModelReward
    from polyrl.rewards.remote import RemoteReward

    alg, rc = cfg.algorithm, cfg.algorithm.rollout_correction
    return isinstance(reward, (RemoteModelReward, RemoteReward)) and not (
        alg.filter_groups.enable or alg.adv_estimator == "remax" or (rc.enabled and not rc.bypass_mode)
        or cfg.async_training.partial_rollout)


class RolloutWorker:
    """The rollout process: generates and scores batch after batch with the newest weights the age limit allows
    (evaluating stale batches' behaviour log-probs where decoupled rollout correction asks for them), and sends each
    batch to the trainer. A reward in a process of its own scores one batch behind the generation
    (trainer/scoring_behind.py)."""

    def __init__(self, cfg, dist_env: DistEnv):
        self.link = object_link()  # both roles' first call, so the groups pair up
        cfg = copy.deepcopy(cfg)
        resolve_defaults(cfg)
        # no reference model, critic, logs or resumed state here: the trainer owns those, and sends the start position
        cfg.actor_rollout_ref.actor.use_kl_loss = False
        cfg.algorithm.use_kl_in_reward = False
        cfg.critic.enable = False
        cfg.trainer.resume_mode = "disable"
        cfg.trainer.logger = []
        cfg.actor_rollout_ref.rollout.free_cache_engine = False  # the GPU is the engine's: keep the KV cache
        # its config/env files beside the trainer's run when that is named, else in a scratch folder (the trainer's
        # timestamped run directory is only chosen in the trainer process)
        cfg.trainer.run_dir = os.path.join(cfg.trainer.run_dir or tempfile.mkdtemp(prefix="polyrl-"), "rollout")
        self.max_age = cfg.async_training.max_trajectory_age_steps
        self.roll = _RolloutRole(cfg, dist=dist_env)
        self.timer = StepTimer()
        spec = tensor_spec(merged_state_dict(self.roll.model).items())
        self.receiver = WeightReceiver(TRAINER_RANK, spec, _bucket_bytes(cfg), self.roll.device)
        self.version = 0
        r = cfg.actor_rollout_ref.rollout
        self.partial = PartialRollouts(r.n, r.response_length, partial_rollout_cap(cfg)) \
            if cfg.async_training.partial_rollout else None
        self.behind = ScoringBehind(self.roll, self._message, self._send) if scores_behind(cfg, self.roll.reward) \
            else None
        self.pending: list = []  # the works of the last message sent

    def serve(self) -> None:
        hello = recv_object(TRAINER_RANK, self.link)
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
                    self._send(self._batch(k))
            except ScoringFailed:  # the thread has told the trainer
                raise
            except Exception as e:  # the trainer stops with this sentence instead of a broken-pipe error
                if self.behind is not None:
                    self.behind.close()  # the batches before this one go first (or their failure is the news)
                self._send({"batch_index": k, "error": f"{type(e).__name__}: {e}"})
                self._wait_sent()
                raise
        if self.behind is not None:
            self.behind.close()
        self._wait_sent()  # the trainer has taken the last batch: nothing more to do here

    def _send(self, msg: dict) -> None:
        """Send a message to the trainer; the previous one has long arrived: keep at most one in flight."""
        self._wait_sent()
        self.pending = send_object(msg, TRAINER_RANK, self.link)

    def _wait_sent(self) -> None:
        for w in self.pending:
            w.wait()
        self.pending = []

    def _batch(self, k: int) -> dict:
        roll = self.roll
        if self.partial is not None:
            samples, batch, index, metrics, versions = self._partial_batch()
        else:
            samples, batch, index, metrics = roll._collect_batch(self.timer)
            versions = [self.version] * batch["responses"].shape[0]
        position = {"sampler": (self.partial and self.partial.resume_state()) or roll.sampler.state_dict(),
                    "engine": roll._engine_generator_state()}
        return self._message(k, samples, batch, index, metrics, self.timer.pop(), versions, position)

    def _message(self, k, samples, batch, index, metrics, timings, versions, position) -> dict:
        """Batch k for the trainer: its tensors on the CPU, where its pi_old comes from, its weight versions and the
        data position a resume starts generating from (before the oldest prompts still in flight, if any)."""
        roll = self.roll
        behaviour = behaviour_source(roll.cfg.algorithm.rollout_correction, stale=min(versions) < k)
        if behaviour == "recomputed":  # the generating weights' log-probs at the trainer's precision
            assert self.behind is None  # scores_behind: never with decoupled correction
            with self.timer.stage("behaviour_log_prob"):
                batch["old_log_probs"] = roll._old_logprobs(roll.model, batch, roll._update_settings(batch))
            timings = {**timings, **self.timer.pop()}
        timings.setdefault("timing_s/rollout_update_weights", 0.0)
        return {"batch_index": k, "samples": samples, "index": index, "metrics": metrics, "timings": timings,
                "batch": {key: v.cpu() for key, v in batch.items()}, "behaviour": behaviour,
                "weight_versions": versions, "engine": position["engine"], "sampler": position["sampler"]}

    def _partial_batch(self):
        """Partial rollouts (trainer/partial_rollout.py): draw a batch of prompts, decode every row in flight up to
        the cap, and repeat until enough groups have finished; ship the oldest finished ones."""
        roll, pool, timer = self.roll, self.partial, self.timer
        want, sampling = roll.cfg.data.train_batch_size, roll._sampling_params()
        calls = on_cache = 0
        while not calls or pool.num_done() < want:
            state = copy.deepcopy(roll.sampler.state_dict())
            pool.add(roll.sampler.next_batch(), state)
            prompts, rows, caps = pool.requests()
            with timer.stage("gen"):
                out = roll.oom.run("gen", lambda: roll._generate(prompts, continuation_sampling(sampling, rows, caps)),
                                   ctx=StageContext(engine=roll.engine))
            pool.absorb(out, rows, caps, self.version)
            calls += 1
            on_cache += getattr(roll.engine, "stats", {}).get("num_resumed", 0)
        groups = pool.take(want)
        prompts, out = as_part(groups)
        metrics = {**row_metrics(groups), "async/partial_rollout/gen_calls": float(calls),
                   "async/partial_rollout/rows_continued_on_kept_cache": float(on_cache),
                   "async/partial_rollout/groups_in_flight": float(len(pool.groups))}
        part = roll._scored_part(prompts, out, timer, metrics)
        samples, batch, index, metrics = roll._assemble_batch([part], want, metrics)
        return samples, batch, index, metrics, [r.first_version for g in groups for r in g.rows]

    @torch.no_grad()
    def _load_weights(self, version: int) -> None:
        """Receive weights `version` into the full-precision model, then into the engine's own copy (if separate)."""
        with self.timer.stage("rollout_update_weights"):
            params = merged_state_dict(self.roll.model)
            for name, t in self.receiver.receive():
                params[name].copy_(t)
            self.roll.engine.update_weights(self.roll._weights_for_rollout())
        self.version = version


# ------------------------------------------------------------------------------------------------ the job
def join_job(cfg) -> tuple[int, DistEnv]:
    """Join the 2-process job torchrun (or a test) started; each role gets a one-process `DistEnv` on its device."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world != 2:
        raise UserError(f"actor_rollout_ref.hybrid_engine=False runs as 2 processes (1 trainer, 1 rollout) but this "
                        f"job has {world}; start it with `polyrl train` (it launches them) or torchrun "
                        "--nproc_per_node=2.")
    local = int(os.environ.get("LOCAL_RANK", rank))
    want = cfg.trainer.device
    cuda = want.startswith("cuda") or (want == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        use_expandable_segments()
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # a wait here can last a whole step (and a validation): at least an hour
        timeout = max(cfg.actor_rollout_ref.nccl_timeout, PIPELINE_MIN_TIMEOUT_S)
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout), device_id=device if cuda else None)
    # rank 0 of a world of its own: each role seeds, samples and reduces as one on-policy process would
    return rank, DistEnv(rank=0, world_size=1, local_rank=local, device=device)


def train_async(cfg) -> AsyncPPOTrainer | None:
    """Run this process's role to the end; the trainer is returned on rank 0, None on the rollout process."""
    rank, env = join_job(cfg)
    try:
        if rank == TRAINER_RANK:
            trainer = AsyncPPOTrainer(cfg, env)
            trainer.fit()
            trainer.finish()
            return trainer
        RolloutWorker(cfg, env).serve()
        return None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
