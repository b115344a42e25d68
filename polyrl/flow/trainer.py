"""The FlowGRPO loop. `step()` reads top to bottom as DESIGN.md's dataflow, each stage timed under verl's names.

    prompts --gen--> SDE trajectories (x, x_next, rollout log-prob on the trained steps) + clean latents
            --reward--> VAE decode + reward fn (optionally in a worker process, overlapping generation)
            --adv--> per-group FlowGRPO advantages (global std, clipped)
            --update_actor--> per mini-batch: for each micro-batch and each trained step, forward + clipped loss
                              (+ beta KL to the reference) + backward; then grad clip and one AdamW step

Deviations from the papers/upstream, on purpose:
- old log-probs are the rollout's (flow_grpo); verl-omni recomputes them with the actor (~20% of a step). Rollout and
  training use the same micro-batch shapes, so on-policy ratios are exactly 1 (tested).
- one SDE window per batch (flow_grpo); verl-omni draws one per sample. The last grid step is always ODE.
- samples in zero-std groups (advantage exactly 0) are skipped in the update: their loss gradient is 0 anyway.
- no EMA of the weights (flow_grpo's SD3 eval uses one).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass

import torch

from polyrl.flow import algos, sampler
from polyrl.flow import sde as sde_lib
from polyrl.flow.config import FlowConfig
from polyrl.flow.pipeline import FlowPolicy
from polyrl.utils.timing import StepTimer

RewardFn = Callable[[torch.Tensor, list[str], list[dict]], torch.Tensor]


@dataclass
class Rollout:
    """One RL step's samples: prompts (B = prompts x n), group ids, trajectories and final latents."""

    prompts: list[str]
    metadata: list[dict]
    group_ids: list[int]
    traj: sampler.Trajectory
    sigmas: torch.Tensor


class FlowGRPOTrainer:
    """Owns the policy, optimizer, reward function and prompts; `fit()` runs the configured number of steps."""

    def __init__(self, cfg: FlowConfig, policy: FlowPolicy, reward_fn: RewardFn, train_prompts: list[tuple[str, dict]],
                 val_prompts: list[tuple[str, dict]], *, tracker=None, timer: StepTimer | None = None,
                 async_scorer=None):  # fmt: skip
        self.cfg, self.policy, self.reward_fn = cfg, policy, reward_fn
        self.train_prompts, self.val_prompts = train_prompts, val_prompts
        from polyrl.utils.profiler import Profiler

        self.profiler = Profiler(cfg.global_profiler)  # no-op unless global_profiler.tool is set
        self.tracker, self.timer = tracker, timer or StepTimer()
        self.timer.hooks.append(self.profiler)
        self.async_scorer = async_scorer
        actor = cfg.actor_rollout_ref.actor
        sde_lib.check_step_type(cfg.actor_rollout_ref.rollout.algo.sde_type)
        self._check_batches()
        if actor.use_kl_loss:
            policy.make_reference()
        params = policy.trainable_parameters()
        # fp32 optimizer state even for bf16 weights is what full fine-tuning needs; AdamW keeps state in the
        # parameter dtype, so low-precision weights are trained through fp32 master copies only when the
        # model is loaded in fp32 (the default here).
        self.optimizer = torch.optim.AdamW(params, lr=actor.optim.lr, weight_decay=actor.optim.weight_decay,
                                           betas=tuple(actor.optim.betas))  # fmt: skip
        warmup = actor.optim.lr_warmup_steps
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda i: min(1.0, (i + 1) / max(warmup, 1)))
        self.global_step = 0
        self._data_gen = torch.Generator().manual_seed(cfg.data.seed)
        self._noise_gen = torch.Generator().manual_seed(cfg.actor_rollout_ref.rollout.seed)
        self._order: list[int] = []

    def _check_batches(self) -> None:
        from polyrl.errors import ConfigError

        d, a = self.cfg.data, self.cfg.actor_rollout_ref.actor
        if d.train_batch_size % a.ppo_mini_batch_size:
            raise ConfigError(
                f"data.train_batch_size={d.train_batch_size} is not a multiple of "
                f"actor_rollout_ref.actor.ppo_mini_batch_size={a.ppo_mini_batch_size}; make it one."
            )
        if self.cfg.actor_rollout_ref.rollout.n < 2:
            raise ConfigError(
                f"actor_rollout_ref.rollout.n={self.cfg.actor_rollout_ref.rollout.n}: GRPO needs at least 2 images per prompt."
            )

    # ------------------------------------------------------------------ data

    def _next_prompts(self) -> list[tuple[str, dict]]:
        out = []
        for _ in range(self.cfg.data.train_batch_size):
            if not self._order:
                self._order = torch.randperm(len(self.train_prompts), generator=self._data_gen).tolist()
            out.append(self.train_prompts[self._order.pop()])
        return out

    # ------------------------------------------------------------------ stages

    def generate(self, batch: list[tuple[str, dict]]) -> Rollout:
        """Sample rollout.n images per prompt in micro-batch chunks; one SDE window for the whole batch."""
        ro = self.cfg.actor_rollout_ref.rollout
        n, chunk = ro.n, self.cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
        prompts = [p for p, _ in batch for _ in range(n)]
        metadata = [m for _, m in batch for _ in range(n)]
        group_ids = [i for i in range(len(batch)) for _ in range(n)]
        sigmas = self.policy.sigmas(ro.pipeline.num_inference_steps)
        train_steps = sde_lib.sde_steps(ro.pipeline.num_inference_steps, sde_window_size=ro.algo.sde_window_size,
                                        sde_window_range=ro.algo.sde_window_range,
                                        timestep_fraction=ro.algo.timestep_fraction, generator=self._noise_gen)  # fmt: skip
        parts = []
        for lo in range(0, len(prompts), chunk):
            chunk_prompts = prompts[lo : lo + chunk]
            noise = self.policy.noise(len(chunk_prompts), self._noise_gen)
            parts.append(self._sample(noise, chunk_prompts, sigmas, train_steps, ro.algo.noise_level))
            if self.async_scorer is not None:  # score this chunk in the worker while the next one is generated
                self.async_scorer.submit(lo, self.policy.decode(parts[-1].final_B).cpu(), chunk_prompts,
                                         metadata[lo : lo + chunk])  # fmt: skip
        traj = sampler.Trajectory(
            latents_KB=torch.cat([p.latents_KB for p in parts], dim=1),
            next_latents_KB=torch.cat([p.next_latents_KB for p in parts], dim=1),
            log_probs_KB=torch.cat([p.log_probs_KB for p in parts], dim=1),
            step_indices=parts[0].step_indices,
            final_B=torch.cat([p.final_B for p in parts]),
        )
        return Rollout(prompts, metadata, group_ids, traj, sigmas)

    def _sample(self, noise, prompts, sigmas, train_steps, noise_level) -> sampler.Trajectory:
        ro = self.cfg.actor_rollout_ref.rollout

        def velocity(x, sigma_B):
            return self.policy.velocity(x, sigma_B, prompts)

        return sampler.sample(velocity, noise, sigmas, sde_type=ro.algo.sde_type, noise_level=noise_level,
                              train_steps=train_steps, generator=self._noise_gen)  # fmt: skip

    def score(self, rollout: Rollout) -> torch.Tensor:
        if self.async_scorer is not None:
            return self.async_scorer.collect(len(rollout.prompts))
        images = self.policy.decode(rollout.traj.final_B)
        return torch.as_tensor(self.reward_fn(images, rollout.prompts, rollout.metadata), dtype=torch.float32)

    def update_actor(self, rollout: Rollout, adv_B: torch.Tensor) -> dict[str, float]:
        """PPO epochs over mini-batches of prompts; each trained step is its own forward/backward (accumulated)."""
        cfg = self.cfg.actor_rollout_ref
        actor, algo = cfg.actor, cfg.rollout.algo
        traj, sigmas = rollout.traj, rollout.sigmas
        n = cfg.rollout.n
        mini = actor.ppo_mini_batch_size * n
        micro = actor.ppo_micro_batch_size_per_gpu
        sigma_max = float(sigmas[1])
        totals: dict[str, float] = {}
        num_terms_all, grad_norms = 0, []
        self.policy.transformer.train()
        for _ in range(actor.ppo_epochs):
            for lo in range(0, len(rollout.prompts), mini):
                idx = torch.arange(lo, min(lo + mini, len(rollout.prompts)))
                if actor.skip_zero_adv:
                    idx = idx[adv_B[idx] != 0]
                if len(idx) == 0:
                    continue
                num_terms = len(idx) * len(traj.step_indices)
                metric_sums: dict[str, torch.Tensor] = {}
                for mlo in range(0, len(idx), micro):
                    mb = idx[mlo : mlo + micro]
                    prompts = [rollout.prompts[i] for i in mb.tolist()]
                    for k, i in enumerate(traj.step_indices):
                        x = traj.latents_KB[k, mb]
                        sigma_B = sigmas[i].expand(len(mb)).to(x.device)
                        v = self.policy.velocity(x, sigma_B, prompts)
                        out = sde_lib.step(algo.sde_type, x, v, sigmas[i], sigmas[i + 1], noise_level=algo.noise_level,
                                           sigma_max=sigma_max, x_next=traj.next_latents_KB[k, mb])  # fmt: skip
                        kl_B = None
                        if actor.use_kl_loss:
                            v_ref = self.policy.velocity(x, sigma_B, prompts, reference=True)
                            ref = sde_lib.step(algo.sde_type, x, v_ref, sigmas[i], sigmas[i + 1],
                                               noise_level=algo.noise_level, sigma_max=sigma_max)  # fmt: skip
                            kl_B = sde_lib.kl_to_ref(actor.kl_loss_type, mean=out.mean, ref_mean=ref.mean, std=out.std,
                                                     v=v, ref_v=v_ref)  # fmt: skip
                        loss, m = algos.clipped_loss(
                            out.log_prob_B, traj.log_probs_KB[k, mb].to(out.log_prob_B.device), adv_B[mb].to(x.device),
                            clip_ratio=actor.diffusion_loss.clip_ratio, num_terms=num_terms, kl_B=kl_B,
                            kl_coef=actor.kl_loss_coef,
                        )  # fmt: skip
                        loss.backward()
                        for key, val in m.items():
                            metric_sums[key] = metric_sums.get(key, 0) + val
                params = self.policy.trainable_parameters()
                grad_norm = torch.nn.utils.clip_grad_norm_(params, actor.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                self.lr_scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                grad_norms.append(float(grad_norm))
                for key, val in metric_sums.items():
                    totals[key] = totals.get(key, 0.0) + float(val)
                num_terms_all += num_terms
        self.policy.transformer.eval()
        metrics = {k: v / max(num_terms_all, 1) for k, v in totals.items()}
        if metrics:
            metrics["actor/pg_clipfrac"] = metrics["actor/pg_clipfrac_higher"] + metrics["actor/pg_clipfrac_lower"]
            metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
            metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["actor/num_trained_samples"] = num_terms_all / max(len(traj.step_indices), 1)
        return metrics

    # ------------------------------------------------------------------ the step

    def step(self) -> dict[str, float]:
        ro = self.cfg.actor_rollout_ref.rollout
        t0 = time.perf_counter()
        self.profiler.step_start(self.global_step + 1)
        with self.timer.stage("step"):
            batch = self._next_prompts()
            with self.timer.stage("gen"):
                rollout = self.generate(batch)
            with self.timer.stage("reward"):
                scores_B = self.score(rollout)
            with self.timer.stage("adv"):
                a = self.cfg.algorithm
                adv_B = algos.flow_grpo_advantages(
                    scores_B, rollout.group_ids, norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo,
                    global_std=a.global_std, adv_clip_max=self.cfg.actor_rollout_ref.actor.diffusion_loss.adv_clip_max,
                )  # fmt: skip
            with self.timer.stage("update_actor"):
                metrics = self.update_actor(rollout, adv_B)
        self.global_step += 1
        self.profiler.step_end(self.global_step)
        dt = time.perf_counter() - t0
        group_std = torch.stack([scores_B[torch.tensor(rollout.group_ids) == g].std()
                                 for g in sorted(set(rollout.group_ids))])  # fmt: skip
        metrics.update({
            "critic/rewards/mean": float(scores_B.mean()),
            "critic/rewards/std": float(scores_B.std()),
            "critic/rewards/max": float(scores_B.max()),
            "critic/rewards/min": float(scores_B.min()),
            "critic/rewards/std_mean": float(group_std.mean()),
            "critic/rewards/zero_std_ratio": algos.zero_std_ratio(scores_B, rollout.group_ids),
            "critic/rewards/group_size": float(ro.n),
            "critic/advantages/mean": float(adv_B.mean()),
            "critic/advantages/max": float(adv_B.max()),
            "critic/advantages/min": float(adv_B.min()),
            "perf/throughput": len(rollout.prompts) / dt / _world_size(),
            "perf/time_per_step": dt,
            "training/global_step": float(self.global_step),
        })  # fmt: skip
        if torch.cuda.is_available():
            metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        metrics.update(self.timer.pop())
        return metrics

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """ODE sampling (val_kwargs) with fixed noise on the held-out prompts; one image per prompt."""
        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        gen = torch.Generator().manual_seed(vk.seed)
        sigmas = self.policy.sigmas(vk.num_inference_steps)
        scores = []
        chunk = self.cfg.data.val_batch_size
        with self.timer.stage("testing"):
            for lo in range(0, len(self.val_prompts), chunk):
                part = self.val_prompts[lo : lo + chunk]
                prompts, metadata = [p for p, _ in part], [m for _, m in part]
                noise = self.policy.noise(len(part), gen)
                traj = sampler.sample(lambda x, s: self.policy.velocity(x, s, prompts), noise, sigmas,
                                      sde_type=self.cfg.actor_rollout_ref.rollout.algo.sde_type,
                                      noise_level=vk.noise_level, train_steps=[], generator=gen)  # fmt: skip
                images = self.policy.decode(traj.final_B)
                if lo == 0 and self.tracker is not None:  # a grid of validation samples for the run report
                    self._log_samples(images[:16])
                scores.append(torch.as_tensor(self.reward_fn(images, prompts, metadata), dtype=torch.float32))
        mean = float(torch.cat(scores).mean()) if scores else math.nan
        return {f"val-core/{self.cfg.data.data_source}/reward/mean@1": mean}

    def _log_samples(self, images_BCHW: torch.Tensor) -> None:
        arr = (images_BCHW.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        if arr.shape[-1] == 1:
            arr = arr[..., 0]
        self.tracker.log_images("val/samples", list(arr), step=self.global_step)

    # ------------------------------------------------------------------ checkpoints

    def _trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.policy.transformer.named_parameters() if p.requires_grad}

    def save_checkpoint(self, root: str) -> None:
        """Trainable weights (LoRA or all), optimizer, step and RNG streams, atomically (polyrl.utils.checkpoint)."""
        from polyrl.utils.checkpoint import CheckpointManager

        with self.timer.stage("save_checkpoint"):
            CheckpointManager(root).save(self.global_step, {
                "model": self._trainable_state(),
                "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "trainer": {"global_step": self.global_step, "noise_rng": self._noise_gen.get_state(),
                            "data_rng": self._data_gen.get_state(), "order": list(self._order)},
            })  # fmt: skip

    def load_checkpoint(self, root: str) -> bool:
        """Resume from the latest complete checkpoint under `root`; False when there is none."""
        from polyrl.utils.checkpoint import CheckpointManager

        mgr = CheckpointManager(root)
        step = mgr.latest_step()
        if step is None:
            return False
        state = mgr.load(step)
        params = dict(self.policy.transformer.named_parameters())
        with torch.no_grad():
            for name, value in state["model"].items():
                params[name].copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        t = state["trainer"]
        self.global_step = int(t["global_step"])
        self._noise_gen.set_state(t["noise_rng"])
        self._data_gen.set_state(t["data_rng"])
        self._order = list(t["order"])
        return True

    def fit(self, progress: bool | None = None) -> dict[str, list[float]]:
        """Run trainer.total_training_steps steps with validation; returns {"val": [...], "train": [...]} rewards."""
        t = self.cfg.trainer
        history = {"val": [], "train": []}
        val_key = f"val-core/{self.cfg.data.data_source}/reward/mean@1"

        def run_val():
            m = self.validate()
            history["val"].append(m[val_key])
            m.update(self.timer.pop())  # timing_s/testing
            return m

        if t.val_before_train and t.test_freq > 0:
            m = run_val()
            if self.tracker:
                self.tracker.log(m, step=0)
        show = t.progress_bar if progress is None else progress
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=t.total_training_steps, desc="FlowGRPO", unit="step", dynamic_ncols=True)
        ckpt_dir = str(Path(t.default_local_dir) / "checkpoints")
        if t.save_freq > 0 and self.load_checkpoint(ckpt_dir) and bar is not None:
            bar.update(self.global_step)
        while self.global_step < t.total_training_steps:
            m = self.step()
            history["train"].append(m["critic/rewards/mean"])
            last = self.global_step == t.total_training_steps
            if t.test_freq > 0 and (self.global_step % t.test_freq == 0 or last):
                m.update(run_val())
            if t.save_freq > 0 and (self.global_step % t.save_freq == 0 or last):
                self.save_checkpoint(ckpt_dir)
                m.update(self.timer.pop())
            if self.tracker:
                self.tracker.log(m, step=self.global_step)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{m['critic/rewards/mean']:.3f}", val=f"{history['val'][-1]:.3f}" if history["val"] else "-")
        if bar is not None:
            bar.close()
        self.profiler.close()
        return history


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1
