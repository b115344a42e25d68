"""The FlowGRPO loop. `step()` reads top to bottom as DESIGN.md's dataflow, each stage timed under verl's names.

    prompts --gen--> SDE trajectories (x, x_next, rollout log-prob on the trained steps) + clean latents
            --reward--> VAE decode + reward fn (optionally in a worker process, overlapping generation)
            --adv--> per-group FlowGRPO advantages (global std, clipped)
            --update_actor--> per mini-batch: for each micro-batch and each trained step, forward + clipped loss
                              (+ beta KL to the reference) + backward; then grad clip and one AdamW step

With the reward in worker processes (`reward.async_reward`) the last rollout chunk is still being scored when
generation ends: the update's first forward is launched first and the rewards are waited for after it
(`update_actor`), so `timing_s/reward` and `timing_s/adv` are then inside `timing_s/update_actor`.

Data parallel (torchrun, or `trainer.n_gpus_per_node > 1`): every rank draws the same global prompt batch and keeps
whole prompt groups of every mini-batch (`polyrl.distributed.data.shard_prompts`), samples and scores them, and trains
the transformer sharded with FSDP2 per block (`polyrl.distributed.dit_fsdp`). Each sample's noise is seeded by (seed, step,
global sample index), the rewards are all-gathered before the advantages, and loss normalisers count the global
mini-batch, so N processes compute the 1-process step up to float summation order (tested).

Deviations from the papers/upstream, on purpose:
- old log-probs are the rollout's (flow_grpo); verl-omni recomputes them with the actor (~20% of a step). Rollout and
  training use the same micro-batch shapes, so on-policy ratios are exactly 1 (tested). FP8 sampling
  (`rollout.quantization=fp8`) runs the ODE steps in FP8 and the trained steps in the model dtype, so their log-probs
  stay pi_old. With FP8 trained steps too (`rollout.fp8_trained_steps`) or `algorithm.rollout_correction` set they are
  recomputed (`timing_s/old_log_prob`) and the LLM's rollout correction weighs each (sample, trained step) by
  pi_old / pi_rollout.
- one SDE window per batch (flow_grpo); verl-omni draws one per sample. The last grid step is always ODE.
- samples in zero-std groups (advantage exactly 0) are skipped in the update: their loss gradient is 0 anyway.
- no EMA of the weights (flow_grpo's SD3 eval uses one).

Memory: gradient checkpointing defaults to auto (None): the run starts without it (fastest), and an out-of-memory
error in the update turns it on, then halves the micro-batch (trainer/oom.py, `FLOW_SHRINKERS`); an OOM in the
rollout halves its chunk. Each change is warned once with the key that avoids it.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from polyrl.distributed import DistEnv
from polyrl.distributed import data as dp_data
from polyrl.distributed.grads import clip_grad_norm_
from polyrl.distributed.parallelize import param_groups
from polyrl.algorithms import flow_grpo
from polyrl.algorithms.rollout_correction import check_rollout_correction, compute_rollout_correction
from polyrl.distributed import dit_fsdp
from polyrl.rollout import fp8_dit, sde_sampler
from polyrl.algorithms import sde as sde_lib
from polyrl.trainer.checks import check_flow_supported
from polyrl.trainer.flow_config import FlowConfig
from polyrl.models.diffusion.pipeline import FlowPolicy
from polyrl.trainer.core import TrainerCore
from polyrl.trainer.metrics import rollout_logprob_gap
from polyrl.trainer.oom import Change, OOMGuard, StageContext
from polyrl.learner.actor import make_scheduler
from polyrl.learner.master_weights import MasterWeights
from polyrl.learner.memory import check_training_state_fits
from polyrl.utils.timing import StepTimer

# With an async scorer, the update's first forward runs while the last chunk is scored (`update_actor`): the wait for
# OCR fell from 0.21-0.26 s to 0.02-0.06 s a step (H200, 2026-11-26; benchmarks/probes/flow_session.sh overlap)

RewardFn = Callable[[torch.Tensor, list[str], list[dict]], torch.Tensor]


def _shrink_flow_update(cfg, ctx: StageContext) -> Change | None:
    """Gradient checkpointing first (the micro-batch shapes stay those of the rollout), then half the micro-batch."""
    roles = cfg.actor_rollout_ref
    if not roles.model.enable_gradient_checkpointing:
        ctx.model.enable_gradient_checkpointing()
        roles.model.enable_gradient_checkpointing = True
        return Change("actor_rollout_ref.model.enable_gradient_checkpointing", False, True)
    old = roles.actor.ppo_micro_batch_size_per_gpu
    roles.actor.ppo_micro_batch_size_per_gpu = max(1, old // 2)
    return Change("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", old, old // 2) if old > 1 else None


def _shrink_flow_gen(cfg, ctx: StageContext) -> Change | None:
    roles = cfg.actor_rollout_ref
    old = roles.rollout.log_prob_micro_batch_size_per_gpu or roles.actor.ppo_micro_batch_size_per_gpu
    roles.rollout.log_prob_micro_batch_size_per_gpu = max(1, old // 2)
    return Change("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", old, old // 2) if old > 1 else None


FLOW_SHRINKERS = {"gen": _shrink_flow_gen, "update_actor": _shrink_flow_update}


def _smaller_images(cfg) -> str:
    p = cfg.actor_rollout_ref.rollout.pipeline
    return f"actor_rollout_ref.rollout.pipeline.height={p.height // 2} and width={p.width // 2}"


def check_batches(cfg: FlowConfig, world_size: int) -> None:
    """Batch arithmetic the trainer needs, at `world_size` processes (the CLI checks it once before launching)."""
    from polyrl.errors import ConfigError

    d, a, n = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    if d.train_batch_size % a.ppo_mini_batch_size:
        raise ConfigError(
            f"data.train_batch_size={d.train_batch_size} is not a multiple of "
            f"actor_rollout_ref.actor.ppo_mini_batch_size={a.ppo_mini_batch_size}; make it one."
        )
    if n < 2:
        raise ConfigError(f"actor_rollout_ref.rollout.n={n}: GRPO needs at least 2 images per prompt.")
    if a.ppo_mini_batch_size % world_size:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={a.ppo_mini_batch_size} prompts cannot be split over "
            f"{world_size} processes by whole prompt groups; make it a multiple of {world_size}."
        )


@dataclass
class FlowSamples:
    """One RL step's samples on this rank: prompts (B = prompts x n), group ids, trajectories and final latents."""

    prompts: list[str]
    metadata: list[dict]
    group_ids: list[int]
    sample_ids: list[int]
    """Index of each sample in the global batch (prompt index x n + j): its noise seed and its row in gathers."""
    traj: sde_sampler.Trajectory
    sigmas: torch.Tensor
    old_log_probs_KB: torch.Tensor | None = None
    """The trained policy's log-probs of the rollout's steps before the update (recomputed: FP8 sampling or rollout
    correction); None: the rollout's own are pi_old."""
    is_weights_BK: torch.Tensor | None = None
    """Rollout-correction IS weights per (sample, trained step), or None."""
    keep_BK: torch.Tensor | None = None
    """Rollout-correction rejection mask per (sample, trained step), or None."""
    correction_metrics: dict | None = None
    """rollout_corr/* and training/rollout_probs_diff_* of this batch."""


class FlowGRPOTrainer(TrainerCore):
    """Owns the policy, optimizer, reward function and prompts; `fit()` (trainer/core.py) runs the configured steps.

    `tracker`: log there instead of the run directory's configured loggers (tests)."""

    progress_metric = ("reward", "critic/rewards/mean")
    bar_label = "FlowGRPO"

    def __init__(self, cfg: FlowConfig, policy: FlowPolicy, reward_fn: RewardFn, train_prompts: list[tuple[str, dict]],
                 val_prompts: list[tuple[str, dict]], *, tracker=None, timer: StepTimer | None = None,
                 async_scorer=None, dist: DistEnv | None = None):  # fmt: skip
        self.cfg, self.policy, self.reward_fn = cfg, policy, reward_fn
        self.train_prompts, self.val_prompts = train_prompts, val_prompts
        from polyrl.utils.profiler import Profiler

        self.profiler = Profiler(cfg.global_profiler)  # no-op unless global_profiler.tool is set
        actor = cfg.actor_rollout_ref.actor
        # one process per GPU under torchrun; a single process is a DistEnv of size 1 (every collective a no-op)
        self.dist = dist or DistEnv.setup(next(policy.transformer.parameters()).device.type,
                                          fsdp_size=actor.fsdp_config.fsdp_size,
                                          cpu_offload=actor.fsdp_config.cpu_offload)  # fmt: skip
        sde_lib.check_step_type(cfg.actor_rollout_ref.rollout.algo.sde_type)
        check_batches(cfg, self.dist.world_size)
        check_correction(cfg)
        check_flow_supported(cfg)  # the CLI ran it already; a trainer built directly (tests, quickstart) runs it here
        self.open_run()  # checkpoints, the checkpoint to resume, this run's directory (trainer/core.py)
        self.tracker = tracker or self.open_tracker()
        self.total_steps = cfg.trainer.total_training_steps
        self.timer = timer or StepTimer()
        self.timer.hooks.append(self.profiler)
        self.async_scorer = async_scorer
        # FP8 GEMMs for the sampling forwards only (polyrl/rollout/fp8_dit.py); before compile and sharding
        ro = cfg.actor_rollout_ref.rollout
        self.fp8 = fp8_dit.build(ro.quantization, policy.transformer, self.dist.world_size, ro.fp8_trained_steps)
        if actor.use_kl_loss:  # before sharding: full fine-tuning's reference is then a plain frozen copy per rank
            policy.make_reference()
        if actor.use_torch_compile or actor.fsdp_config.use_torch_compile:  # per block, before FSDP2 wraps them
            policy.compile_blocks()
        compute = dit_fsdp.compute_dtype(policy.transformer, actor.fsdp_config, policy.device)
        if compute != policy.dtype:  # fp32 weights computed in bf16 (mixed_precision.param_dtype)
            policy.compute_in(compute)
        dit_fsdp.shard_transformer(policy.transformer, self.dist, actor.fsdp_config)
        # fp32 trainable weights over a lower compute dtype (LoRA on a bf16 base, or fp32 full fine-tuning with
        # mixed_precision.param_dtype=bf16 on GPU): the module computes in it and the optimizer steps fp32 masters;
        # an fp32 LoRA matmul would cast every activation to fp32 (FSDP2 does the same with several processes)
        self.master = None
        if not self.dist.is_distributed and _wider_trainables(policy.transformer, compute):
            self.master = MasterWeights(policy.transformer, compute_dtype=compute)
        # sharded (DTensor) and replicated parameters in separate groups: foreach AdamW refuses a mix
        params = self.master.master if self.master else param_groups(policy.transformer)
        if params and isinstance(params[0], dict):
            params = [g for g in params if g["params"]]
        # AdamW keeps its state in the dtype of what it steps: fp32 for fp32 weights (the default model.dtype) and
        # for masters; a model loaded in bf16 and fully fine-tuned has bf16 state.
        self.optimizer = torch.optim.AdamW(params, lr=actor.optim.lr, weight_decay=actor.optim.weight_decay,
                                           betas=tuple(actor.optim.betas))  # fmt: skip
        check_training_state_fits(self.optimizer, policy.device, self.dist.world_size,
                                  offloaded=actor.fsdp_config.cpu_offload)  # fmt: skip
        self.lr_scheduler = make_scheduler(self.optimizer, total_steps=self.total_steps,
                                           warmup_steps=actor.optim.lr_warmup_steps, kind="constant", min_lr_ratio=0.0,
                                           num_cycles=0.5)  # fmt: skip
        self.global_step = 0
        self._data_gen = torch.Generator().manual_seed(cfg.data.seed)
        self._noise_gen = torch.Generator().manual_seed(cfg.actor_rollout_ref.rollout.seed)
        self._order: list[int] = []
        self.mini_batches_applied = 0  # of the current update (trainer/oom.py)
        model = cfg.actor_rollout_ref.model
        if model.enable_gradient_checkpointing is None:
            model.enable_gradient_checkpointing = False
            if self.dist.is_rank0:
                print("polyrl: auto actor_rollout_ref.model.enable_gradient_checkpointing=False (fastest; an "
                      "out-of-memory error in the update turns it on)", flush=True)
        self.oom = OOMGuard(cfg, distributed=self.dist.is_distributed, optimizers=[self.optimizer],
                            shrinkers=FLOW_SHRINKERS, last_resort=_smaller_images)
        self.resume()

    # ------------------------------------------------------------------ data

    def _next_prompts(self) -> list[tuple[str, dict]]:
        out = []
        for _ in range(self.cfg.data.train_batch_size):
            if not self._order:
                self._order = torch.randperm(len(self.train_prompts), generator=self._data_gen).tolist()
            out.append(self.train_prompts[self._order.pop()])
        return out

    # ------------------------------------------------------------------ stages

    def generate(self, batch: list[tuple[str, dict]], prompt_ids: list[int] | None = None) -> FlowSamples:
        """Sample rollout.n images per prompt in micro-batch chunks; one SDE window for the whole batch.

        `prompt_ids`: each prompt's index in the global batch (default 0..len-1); it seeds the samples' noise."""
        ro = self.cfg.actor_rollout_ref.rollout
        n = ro.n
        chunk = ro.log_prob_micro_batch_size_per_gpu or self.cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
        prompt_ids = list(range(len(batch))) if prompt_ids is None else prompt_ids
        prompts = [p for p, _ in batch for _ in range(n)]
        metadata = [m for _, m in batch for _ in range(n)]
        group_ids = [i for i in prompt_ids for _ in range(n)]
        sample_ids = [i * n + j for i in prompt_ids for j in range(n)]
        # the window comes from the generator every rank advances identically: all ranks train the same steps
        sigmas = self.policy.sigmas(ro.pipeline.num_inference_steps)
        train_steps = sde_lib.sde_steps(ro.pipeline.num_inference_steps, sde_window_size=ro.algo.sde_window_size,
                                        sde_window_range=ro.algo.sde_window_range,
                                        timestep_fraction=ro.algo.timestep_fraction, generator=self._noise_gen)  # fmt: skip
        if not self.cfg.actor_rollout_ref.model.cache_prompt_embeds:  # encoded here, reused by this step's update
            self.policy.clear_prompt_cache()
        with self.timer.stage("encode_prompts"):
            self.policy.cache_prompts(prompts)
        if self.fp8 is not None:
            with self.timer.stage("fp8_quantise"):  # the e4m3 copies (again, after an update made them stale)
                self.fp8.prepare()
        parts = []
        for lo in range(0, len(prompts), chunk):
            chunk_prompts = prompts[lo : lo + chunk]
            gens = sde_sampler.sample_generators(ro.seed, self.global_step, sample_ids[lo : lo + chunk])
            noise = torch.cat([self.policy.noise(1, g) for g in gens])
            with fp8_dit.rollout_precision(self.fp8):
                parts.append(self._sample(noise, chunk_prompts, sigmas, train_steps, ro.algo.noise_level, gens))
            if self.async_scorer is not None:  # score this chunk in the worker while the next one is generated
                with self.timer.stage("decode"):
                    images = self.policy.decode(parts[-1].final_B).cpu()
                self.async_scorer.submit(lo, images, chunk_prompts, metadata[lo : lo + chunk])
        if self.fp8 is not None:  # copies the update will make stale: their memory goes to the update
            self.fp8.release()
        traj = sde_sampler.Trajectory(
            latents_KB=torch.cat([p.latents_KB for p in parts], dim=1),
            next_latents_KB=torch.cat([p.next_latents_KB for p in parts], dim=1),
            log_probs_KB=torch.cat([p.log_probs_KB for p in parts], dim=1),
            step_indices=parts[0].step_indices,
            final_B=torch.cat([p.final_B for p in parts]),
        )
        return FlowSamples(prompts, metadata, group_ids, sample_ids, traj, sigmas)

    def _sample(self, noise, prompts, sigmas, train_steps, noise_level, generators) -> sde_sampler.Trajectory:
        ro = self.cfg.actor_rollout_ref.rollout

        def velocity(x, sigma_B):
            return self.policy.velocity(x, sigma_B, prompts)

        return sde_sampler.sample(velocity, noise, sigmas, sde_type=ro.algo.sde_type, noise_level=noise_level,
                                  train_steps=train_steps, generators=generators,
                                  step_precision=fp8_dit.step_precision(self.fp8, ro.fp8_trained_steps))  # fmt: skip

    def score(self, rollout: FlowSamples) -> torch.Tensor:
        if self.async_scorer is not None:
            return self.async_scorer.collect(len(rollout.prompts))
        images = self.policy.decode(rollout.traj.final_B)
        return torch.as_tensor(self.reward_fn(images, rollout.prompts, rollout.metadata), dtype=torch.float32)

    def _advantages(self, batch, rollout: FlowSamples) -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor]:
        """The step's rewards (waited for, with an async scorer) and GRPO advantages: (every rank's scores, their
        groups, every rank's advantages, this rank's advantages)."""
        with self.timer.stage("reward"):
            scores_B = self.score(rollout)
        with self.timer.stage("adv"):
            # the whole batch's rewards on every rank (small): global_std and every metric below are then
            # computed exactly as in one process, and each rank takes its samples' advantages
            n = self.cfg.actor_rollout_ref.rollout.n
            all_scores = dit_fsdp.gather_rows(self.dist, scores_B, rollout.sample_ids, len(batch) * n)
            all_groups = [i // n for i in range(len(batch) * n)]
            a = self.cfg.algorithm
            all_adv = flow_grpo.flow_grpo_advantages(
                all_scores, all_groups, norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo,
                global_std=a.global_std, adv_clip_max=self.cfg.actor_rollout_ref.actor.diffusion_loss.adv_clip_max,
            )  # fmt: skip
        return all_scores, all_groups, all_adv, all_adv[torch.tensor(rollout.sample_ids)]

    def update_actor(self, rollout: FlowSamples, adv_B: torch.Tensor | Callable[[], torch.Tensor],
                     skip_mini_batches: int = 0) -> dict[str, float]:
        """PPO epochs over mini-batches of prompts; each trained step is its own forward/backward (accumulated).
        `skip_mini_batches`: already applied by an attempt that ran out of memory (trainer/oom.py resumes after them).

        `adv_B` may be a function that waits for the rewards (the async scorer's last chunk): the first micro-batch's
        first trained forward is launched before it is called, so the GPU computes it while the CPU waits. With
        `skip_zero_adv` the micro-batch is guessed unfiltered and the forward is dropped if the guess was wrong (one
        process only: ranks must run the same passes).

        With several processes each rank holds its slice of every mini-batch: the loss normaliser counts the global
        mini-batch and each rank's loss is scaled by the process count (FSDP averages gradients over ranks), so the
        update is the 1-process one. FSDP's collectives also need the same number of passes on every rank: a rank
        with fewer non-skipped samples than another runs zero-weight passes."""
        cfg = self.cfg.actor_rollout_ref
        actor = cfg.actor
        traj = rollout.traj
        world = self.dist.world_size
        mini = actor.ppo_mini_batch_size * cfg.rollout.n // world  # this rank's share of a mini-batch
        micro = actor.ppo_micro_batch_size_per_gpu
        totals: dict[str, float] = {}
        num_terms_all, grad_norms = 0, []
        # the optimizer's: FSDP2 leaves a block's *unsharded* parameters registered on the module between a forward
        # without reshard (the last block's) and the next backward, so the module's list is not always these
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self._needs_old_log_probs() and rollout.old_log_probs_KB is None:  # once: an OOM retry keeps it
            with self.timer.stage("old_log_prob"):
                self._correct_rollout(rollout)
        self.policy.transformer.train()
        ahead = None  # (samples, step 0's forward) run while the rewards were waited for
        if callable(adv_B):
            if skip_mini_batches == 0 and actor.ppo_epochs > 0 and not (actor.skip_zero_adv and world > 1):
                mb = torch.arange(0, min(micro, mini, len(rollout.prompts)))
                ahead = mb, self._trained_forward(rollout, mb, 0)
            adv_B = adv_B()
        self.mini_batches_applied, num_seen = skip_mini_batches, 0
        for _ in range(actor.ppo_epochs):
            for lo in range(0, len(rollout.prompts), mini):
                num_seen += 1
                if num_seen <= skip_mini_batches:
                    continue
                idx = torch.arange(lo, min(lo + mini, len(rollout.prompts)))
                if actor.skip_zero_adv:
                    idx = idx[adv_B[idx] != 0]
                counts = self.dist.all_gather_object(len(idx))
                if sum(counts) == 0:
                    self.mini_batches_applied += 1
                    continue
                num_terms = sum(counts) * len(traj.step_indices)
                metric_sums: dict[str, torch.Tensor] = {}
                for k in range(max(math.ceil(c / micro) for c in counts)):
                    mb, weight = idx[k * micro : (k + 1) * micro], 1.0
                    if len(mb) == 0:  # padding pass: keeps this rank's collectives in step with the others
                        mb, weight = torch.arange(lo, lo + 1), 0.0
                    first = None
                    if ahead is not None and torch.equal(ahead[0], mb):
                        first = ahead[1]
                    ahead = None  # used, or a wrong guess dropped
                    self._micro_batch_backward(rollout, adv_B, mb, num_terms, weight * world, metric_sums, first)
                grad_norm = clip_grad_norm_(params, actor.grad_clip)  # the global norm on every rank
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                    if self.master is not None:
                        self.master.copy_to_model()
                self.lr_scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                grad_norms.append(float(grad_norm))
                for key, val in metric_sums.items():
                    totals[key] = totals.get(key, 0.0) + float(val)
                num_terms_all += num_terms
                self.mini_batches_applied += 1
        self.policy.transformer.eval()
        totals = self._sum_over_ranks(totals)
        metrics = {k: v / max(num_terms_all, 1) for k, v in totals.items()}
        if metrics:
            metrics["actor/pg_clipfrac"] = metrics["actor/pg_clipfrac_higher"] + metrics["actor/pg_clipfrac_lower"]
            metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
            metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["actor/num_trained_samples"] = num_terms_all / max(len(traj.step_indices), 1)
        metrics.update(rollout.correction_metrics or {})
        return metrics

    def _needs_old_log_probs(self) -> bool:
        """pi_old differs from the sampler's policy (FP8 GEMMs on the trained steps), or a correction needs both:
        recompute it, as the LLM trainer's old_log_prob pass does for rollout correction."""
        fp8_trained = self.fp8 is not None and self.cfg.actor_rollout_ref.rollout.fp8_trained_steps
        return fp8_trained or self.cfg.algorithm.rollout_correction.enabled

    @torch.no_grad()
    def _correct_rollout(self, rollout: FlowSamples) -> None:
        """pi_old of every trained step in the trained precision (actor micro-batches, the update's batch shapes), then
        the shared rollout correction over [samples, trained steps]: each step plays the part of an LLM token."""
        traj = rollout.traj
        old_KB = torch.empty_like(traj.log_probs_KB)
        micro = self.cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
        for lo in range(0, len(rollout.prompts), micro):
            mb = torch.arange(lo, min(lo + micro, len(rollout.prompts)))
            for k in range(len(traj.step_indices)):
                old_KB[k, mb] = self._policy_step(rollout, mb, k)[0].log_prob_B.to(old_KB)
        old_BK, roll_BK = old_KB.t(), traj.log_probs_KB.t()
        mask_BK = torch.ones_like(old_BK)
        weights_BK, keep_BK, metrics = compute_rollout_correction(old_BK, roll_BK, mask_BK,
                                                                  self.cfg.algorithm.rollout_correction)  # fmt: skip
        metrics.update(rollout_logprob_gap(roll_BK, old_BK, mask_BK))
        rollout.old_log_probs_KB, rollout.is_weights_BK, rollout.correction_metrics = old_KB, weights_BK, metrics
        rollout.keep_BK = keep_BK if self.cfg.algorithm.rollout_correction.rollout_rs is not None else None

    def _policy_step(self, rollout: FlowSamples, mb: torch.Tensor, k: int, reference: bool = False):
        """The policy's (or the reference's) SDE step on trained step k of samples `mb`, towards the sampled next
        latent: (its output, its velocity). Grad as the caller's context has it."""
        algo, traj, sigmas = self.cfg.actor_rollout_ref.rollout.algo, rollout.traj, rollout.sigmas
        i = traj.step_indices[k]
        x = traj.latents_KB[k, mb]
        v = self.policy.velocity(x, sigmas[i].expand(len(mb)).to(x.device), [rollout.prompts[j] for j in mb.tolist()],
                                 reference=reference)  # fmt: skip
        out = sde_lib.step(algo.sde_type, x, v, sigmas[i], sigmas[i + 1], noise_level=algo.noise_level,
                           sigma_max=float(sigmas[1]), x_next=None if reference else traj.next_latents_KB[k, mb])
        return out, v

    def _trained_forward(self, rollout: FlowSamples, mb: torch.Tensor, k: int):
        """The policy's SDE step on trained step k of samples `mb`, with grad: (its output, the KL to the reference
        per sample or None)."""
        actor = self.cfg.actor_rollout_ref.actor
        out, v = self._policy_step(rollout, mb, k)
        kl_B = None
        if actor.use_kl_loss:
            ref, v_ref = self._policy_step(rollout, mb, k, reference=True)
            kl_B = sde_lib.kl_to_ref(actor.kl_loss_type, mean=out.mean, ref_mean=ref.mean, std=out.std,
                                     v=v, ref_v=v_ref)  # fmt: skip
        return out, kl_B

    def _micro_batch_backward(self, rollout: FlowSamples, adv_B, mb, num_terms: int, scale: float, metric_sums,
                              first=None) -> None:
        """Forward + loss (normalised by the mini-batch's `num_terms`) + backward of `loss * scale` for each trained
        step of samples `mb`; its metric sums are added to `metric_sums` (zeros when `scale` is 0: a padding pass).
        `first`: trained step 0's forward of these samples, already run (`update_actor`)."""
        actor = self.cfg.actor_rollout_ref.actor
        traj = rollout.traj
        for k in range(len(traj.step_indices)):
            out, kl_B = first if k == 0 and first is not None else self._trained_forward(rollout, mb, k)
            first = None
            old_KB = traj.log_probs_KB if rollout.old_log_probs_KB is None else rollout.old_log_probs_KB
            loss, m = flow_grpo.clipped_loss(
                out.log_prob_B, old_KB[k, mb].to(out.log_prob_B.device), adv_B[mb].to(out.log_prob_B.device),
                clip_ratio=actor.diffusion_loss.clip_ratio, num_terms=num_terms, kl_B=kl_B,
                kl_coef=actor.kl_loss_coef,
                is_weights_B=None if rollout.is_weights_BK is None else rollout.is_weights_BK[mb, k],
                mask_B=None if rollout.keep_BK is None else rollout.keep_BK[mb, k],
            )  # fmt: skip
            (loss * scale).backward()
            keep = 1.0 if scale else 0.0  # padding passes add zeros: every rank ends up with the same metric keys
            for key, val in m.items():
                metric_sums[key] = metric_sums.get(key, 0) + val * keep

    def _sum_over_ranks(self, totals: dict[str, float]) -> dict[str, float]:
        """Per-rank metric sums -> the job's (every rank trained the same mini-batches, so the keys agree)."""
        if not self.dist.is_distributed or not totals:
            return totals
        keys = sorted(totals)
        packed = self.dist.all_reduce(torch.tensor([totals[k] for k in keys], dtype=torch.float64,
                                                   device=self.dist.device))  # fmt: skip
        return dict(zip(keys, packed.tolist()))

    # ------------------------------------------------------------------ the step

    def step(self) -> dict[str, float]:
        ro = self.cfg.actor_rollout_ref.rollout
        t0 = time.perf_counter()
        self.profiler.step_start(self.global_step + 1)
        with self.timer.stage("step"):
            batch = self._next_prompts()  # the global batch, the same on every rank
            mine = dp_data.shard_prompts(len(batch), self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size,
                                         self.dist.rank, self.dist.world_size)  # fmt: skip
            with self.timer.stage("gen"):
                gen = lambda: self.generate([batch[i] for i in mine], mine)  # noqa: E731
                # an async scorer already holds the chunks made before an OOM: no retry then
                rollout = gen() if self.async_scorer else self.oom.run("gen", gen, generators=[self._noise_gen])
            # (all scores, their groups, all advantages, this rank's): with an async scorer the last chunk is still
            # being scored, so the update's first forward is launched before they are waited for (`update_actor`)
            advantages = functools.cache(lambda: self._advantages(batch, rollout))
            adv_B = (lambda: advantages()[3]) if self.async_scorer else advantages()[3]
            with self.timer.stage("update_actor"):  # an OOM retry resumes after the applied mini-batches
                ctx = StageContext(model=self.policy.transformer, progress=lambda: self.mini_batches_applied)
                metrics = self.oom.run("update_actor", lambda: self.update_actor(rollout, adv_B, ctx.done), ctx=ctx)
            all_scores, all_groups, all_adv, _ = advantages()
        self.global_step += 1
        self.profiler.step_end(self.global_step)
        dt = time.perf_counter() - t0
        group_std = all_scores.view(len(batch), ro.n).std(dim=1)
        metrics.update({
            "critic/rewards/mean": float(all_scores.mean()),
            "critic/rewards/std": float(all_scores.std()),
            "critic/rewards/max": float(all_scores.max()),
            "critic/rewards/min": float(all_scores.min()),
            "critic/rewards/std_mean": float(group_std.mean()),
            "critic/rewards/zero_std_ratio": flow_grpo.zero_std_ratio(all_scores, all_groups),
            "critic/rewards/group_size": float(ro.n),
            "critic/advantages/mean": float(all_adv.mean()),
            "critic/advantages/max": float(all_adv.max()),
            "critic/advantages/min": float(all_adv.min()),
            "perf/throughput": len(rollout.prompts) / dt,  # this rank's images: images/s/GPU
            "perf/time_per_step": dt,
            "training/global_step": float(self.global_step),
        })  # fmt: skip
        if self.async_scorer is None:  # this rank's reward components: reward/<name>, a VLM judge's parse failures
            metrics.update(getattr(self.reward_fn, "last_components", {}))
        if torch.cuda.is_available():
            metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        metrics.update(self.timer.pop())
        if self.dist.is_distributed:  # slowest rank's timings, extremes kept, the rest averaged
            metrics = dp_data.merge_step_metrics(self.dist.all_gather_object(metrics))
        return metrics

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """ODE sampling (val_kwargs) with fixed noise on the held-out prompts; one image per prompt.

        With several processes each rank samples a slice (padded to equal lengths: the passes are collectives) and
        the scores are gathered, so every rank returns the 1-process mean."""
        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        sigmas = self.policy.sigmas(vk.num_inference_steps)
        share, num_real = dp_data.padded_share(len(self.val_prompts), self.dist.rank, self.dist.world_size)
        # every rank draws the whole set's starting noise (small) and keeps its rows: the same draws as one process
        noise_all = self.policy.noise(len(self.val_prompts), torch.Generator().manual_seed(vk.seed))
        scores = [torch.zeros(0)]
        chunk = self.cfg.data.val_batch_size
        with self.timer.stage("testing"):
            for lo in range(0, len(share), chunk):
                ids = share[lo : lo + chunk]
                prompts, metadata = [self.val_prompts[i][0] for i in ids], [self.val_prompts[i][1] for i in ids]
                gens = sde_sampler.sample_generators(vk.seed, 0, ids)  # SDE noise, when val_kwargs.noise_level > 0
                noise = noise_all[torch.tensor(ids, device=noise_all.device)]
                traj = sde_sampler.sample(lambda x, s: self.policy.velocity(x, s, prompts), noise, sigmas,
                                      sde_type=self.cfg.actor_rollout_ref.rollout.algo.sde_type,
                                      noise_level=vk.noise_level, train_steps=[], generators=gens)  # fmt: skip
                images = self.policy.decode(traj.final_B)
                if lo == 0 and self.dist.is_rank0 and images.dim() == 4:  # a grid of validation samples for the run report
                    self._log_samples(images[:16])
                scores.append(torch.as_tensor(self.reward_fn(images, prompts, metadata), dtype=torch.float32).cpu())
        mine = torch.cat(scores)[:num_real]
        every = torch.cat(self.dist.all_gather_object(mine))  # rank order is prompt order
        mean = float(every.mean()) if every.numel() else math.nan
        return {self.val_key: mean, **self.timer.pop()}  # timing_s/testing

    @property
    def val_key(self) -> str:
        return f"val-core/{self.cfg.data.data_source}/reward/mean@1"

    def _log_samples(self, images_BCHW: torch.Tensor) -> None:
        pixels = (images_BCHW.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        if pixels.shape[-1] == 1:
            pixels = pixels[..., 0]
        self.tracker.log_images("val/samples", list(pixels), step=self.global_step)

    # ------------------------------------------------------------------ checkpoints (the protocol: trainer/core.py)

    def _master_named(self):
        return self.master.named() if self.master is not None else None

    def checkpoint_state(self) -> dict:
        """The trainable weights (LoRA or all) and their AdamW state, as full tensors keyed by name."""
        weights, optim = dit_fsdp.gather_trainable_state(self.policy.transformer, self.optimizer, self.dist,
                                                         named=self._master_named())
        return {"model": weights, "optimizer": optim}

    def load_checkpoint_state(self, state: dict) -> None:
        dit_fsdp.load_trainable_state(self.policy.transformer, self.optimizer, state["model"], state["optimizer"],
                                      named=self._master_named())
        if self.master is not None:
            self.master.copy_to_model()

    def sharded_modules(self):
        if self.master is not None:  # its optimizer steps fp32 copies, not the module's parameters
            from polyrl.errors import ConfigError

            raise ConfigError(f"Checkpoint '{self.resume_from}' was written by several processes and this run trains "
                              "fp32 LoRA over a low-precision DiT in one; resume it with trainer.n_gpus_per_node > 1.")
        return {"model": (self.policy.transformer, self.optimizer)}

    def extra_state(self) -> dict:
        return {"scheduler": self.lr_scheduler.state_dict(), "noise_rng": self._noise_gen.get_state(),
                "data_rng": self._data_gen.get_state(), "order": list(self._order),
                "lr": self.optimizer.param_groups[0]["lr"]}  # fmt: skip

    def load_extra_state(self, extra: dict) -> None:
        from polyrl.distributed.checkpoint import regroup_scheduler_state

        # one optimizer group per process, two (sharded, replicated) with several: the schedule is shared
        groups = self.optimizer.param_groups
        self.lr_scheduler.load_state_dict(regroup_scheduler_state(extra["scheduler"], len(groups)))
        for g in groups:
            g["lr"] = extra["lr"]
        self._noise_gen.set_state(extra["noise_rng"])
        self._data_gen.set_state(extra["data_rng"])
        self._order = list(extra["order"])

    def fit(self, progress=None) -> dict[str, list[float]]:
        """TrainerCore.fit; returns {"val": [...], "train": [...]}: held-out and training mean rewards."""
        super().fit(progress)
        return {"val": [m[self.val_key] for m in self.val_history],
                "train": [m["critic/rewards/mean"] for m in self.train_history]}


def check_correction(cfg: FlowConfig) -> None:
    """`algorithm.rollout_correction` as the LLM checks it, less bypass mode (the flow default already is one)."""
    from polyrl.errors import ConfigError

    rc = cfg.algorithm.rollout_correction
    check_rollout_correction(rc)
    if rc.bypass_mode:
        raise ConfigError("algorithm.rollout_correction.bypass_mode=True: without a correction the flow trainer already "
                          "uses the rollout's log-probs as old log-probs; set rollout_is or rollout_rs instead.")


def _wider_trainables(module: torch.nn.Module, compute: torch.dtype) -> bool:
    """True when the trainable weights are fp32 and the module computes in a lower precision: fp32 LoRA on a bf16
    DiT, or fp32 full fine-tuning with `fsdp_config.mixed_precision.param_dtype=bf16` on GPU."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    return bool(trainable) and compute in (torch.bfloat16, torch.float16) and \
        all(p.dtype == torch.float32 for p in trainable)
