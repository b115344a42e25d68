"""The RL trainer for LLMs (GRPO, PPO and relatives): one `step()` is DESIGN.md's dataflow, top to bottom.

    prompts -> gen -> reward -> old_log_prob -> ref -> values -> adv -> update_critic -> update_actor -> update_weights

Each stage is one call, timed as `timing_s/<stage>`; where the batch comes from (gen, reward, DAPO filtering, the
padded batch) is trainer/rollout_batch.py. Where we deviate from verl / the papers:
- Old log-probs are not recomputed when provably identical: with ppo_epochs=1 and a single mini-batch the policy has
  not changed since the rollout, so the update's own forward pass supplies them (`old_log_prob_source=current` in the
  metrics). The ratio is then exactly 1 by construction.
- Rollout and trainer log-probs are both `log_softmax(logits / temperature)`; their gap is logged every step as
  `training/rollout_probs_diff_mean` (the number verl's rollout-correction work is about).
- Rollout correction (`algorithm.rollout_correction.*`, decoupled mode) needs pi_old before the update, so it turns the
  shortcut above off: old log-probs are recomputed (verl's three-policy mode). Its rejection mask replaces the
  response mask before the advantages. `bypass_mode=True` skips that pass instead (old := rollout log-probs) and
  corrects inside the update.
- A non-finite gradient norm skips that optimizer step instead of corrupting the weights (`actor/nonfinite_skipped`).
- A checkpoint is always written at the end, with an HF-format export beside it (no merge step).
- Memory keys left unset are chosen from the free device memory (training/memory.py); a stage that runs out of memory
  is re-run with a smaller token budget / KV cache, or the run stops with one sentence (trainer/oom.py).
"""

from __future__ import annotations

import copy
import json
import os
import time

import numpy as np
import torch

from polyrl.algorithms import apply_kl_in_reward, compute_advantage, make_kl_controller
from polyrl.algorithms.masked import masked_whiten, whiten_over
from polyrl.algorithms.rollout_correction import compute_rollout_correction
from polyrl.agents.runner import build_agent_runner
from polyrl.algorithms.validation import process_validation_metrics
from polyrl.data.dataset import PromptSampler, load_rl_dataset
from polyrl.distributed import DistEnv
from polyrl.distributed.env import launched_world_size, local_device
from polyrl.distributed import data as dp_data
from polyrl.distributed.balance import balance_across_ranks
from polyrl.distributed.parallelize import param_groups
from polyrl.errors import ConfigError
from polyrl.models.loader import load_policy, load_tokenizer, merged_state_dict
from polyrl.models.moe import check_router_replay, find_routers
from polyrl.rewards import RewardManager, build_reward_fn
from polyrl.rewards.model_reward import build_model_reward, resolve_reward_model
from polyrl.rollout import SamplingParams, make_rollout
from polyrl.trainer.checks import check_batch_sizes, check_supported, resolve_model_dtypes
from polyrl.trainer.job import check_data_parallel
from polyrl.trainer.checkpointing import CheckpointingMixin, export_dtype
from polyrl.trainer.core import TrainerCore
from polyrl.trainer.config import PPOConfig
from polyrl.trainer.metrics import data_metrics, rollout_logprob_gap
from polyrl.trainer.oom import OOMGuard, StageContext
from polyrl.trainer.rollout_batch import RolloutBatchMixin
from polyrl.learner.actor import (
    Actor,
    ForwardSettings,
    UpdateSettings,
    compute_logprobs,
    compute_sum_pi_squared,
    make_scheduler,
)
from polyrl.learner.config import micro_batch_per_gpu, mini_batch_per_gpu
from polyrl.learner.critic import explained_variance
from polyrl.learner.memory import (FirstUpdateCalibration, cpu_packs_shared_prompts, plan_memory,
                                  resolve_optimizer_offload, resolve_switches)
from polyrl.utils.device import pick_device
from polyrl.utils.console import bar_lifted
from polyrl.utils.profiler import Profiler
from polyrl.utils.timing import StepTimer


def resolve_defaults(cfg: PPOConfig) -> None:
    """Fill verl's derived defaults (rollout lengths, KL-loss implies a reference, ...) in place."""
    roles = cfg.actor_rollout_ref
    roles.rollout.response_length = roles.rollout.response_length or cfg.data.max_response_length
    roles.rollout.prompt_length = roles.rollout.prompt_length or cfg.data.max_prompt_length
    if roles.actor.optim.warmup_style and roles.actor.optim.lr_scheduler_type == "constant":
        roles.actor.optim.lr_scheduler_type = roles.actor.optim.warmup_style
    if roles.actor.optim.clip_grad is not None:
        roles.actor.grad_clip = roles.actor.optim.clip_grad
    if cfg.critic.enable is None:
        cfg.critic.enable = cfg.algorithm.adv_estimator == "gae"
    if cfg.trainer.default_local_dir is None:
        cfg.trainer.default_local_dir = f"checkpoints/{cfg.trainer.project_name}/{cfg.trainer.experiment_name}"
    resolve_model_dtypes(cfg)  # verl's fsdp_config.model_dtype is model.dtype
    resolve_switches(cfg)  # token-budget micro-batches unless a size is set; the budgets themselves: plan_memory


# estimators whose baseline reads pi_old and sum_v pi_v^2 (old log-probs are then always recomputed)
_NEEDS_SUM_PI_SQUARED = ("optimal_token_baseline", "tir_optimal_token_baseline")


class PPOTrainer(RolloutBatchMixin, CheckpointingMixin, TrainerCore):
    ROLE = "colocated"  # what this process's GPU holds (memory.plan_memory): the off-policy roles say train/rollout

    def __init__(self, cfg: PPOConfig, dist: DistEnv | None = None):
        """`dist`: the process view to train in; None joins the torchrun job (the off-policy pipeline passes each
        role a one-process view of its own, trainer/async_ppo.py)."""
        resolve_defaults(cfg)
        check_supported(cfg)
        check_batch_sizes(cfg)
        if not cfg.actor_rollout_ref.hybrid_engine and dist is None:  # its roles come with their own `dist`
            raise ConfigError("actor_rollout_ref.hybrid_engine=False is the 2-process off-policy pipeline; start it "
                              "with `polyrl train` (trainer/async_ppo.py), not by building a PPOTrainer.")
        self.cfg = cfg
        roles, t = cfg.actor_rollout_ref, cfg.trainer
        # data parallelism (polyrl.distributed): one process per GPU under torchrun; a no-op in a single process
        if dist is None:  # parameters, gradients and AdamW state to host memory where the GPUs cannot hold them
            resolve_optimizer_offload(cfg, world_size=launched_world_size(), device=local_device(t.device),
                                      log=print if int(os.environ.get("RANK", "0")) == 0 else lambda _: None)
        offload = roles.actor.fsdp_config.cpu_offload or roles.ref.fsdp_config.cpu_offload
        self.dist = dist or DistEnv.setup(t.device, fsdp_size=roles.actor.fsdp_config.fsdp_size, cpu_offload=offload,
                                          sp_size=roles.actor.ulysses_sequence_parallel_size,
                                          timeout_s=roles.nccl_timeout)
        check_data_parallel(cfg, self.dist.data.world_size)  # data shards: world / ulysses size
        roles.rollout.seed += self.dist.data.rank  # each data shard samples its own stream
        self.device = self.dist.device if self.dist.is_distributed else pick_device(t.device)
        torch.manual_seed(t.seed)
        np.random.seed(t.seed)
        self.open_run()  # checkpoints, the checkpoint to resume, this run's directory (trainer/core.py)

        self.tokenizer = load_tokenizer(roles.model.tokenizer_path or roles.model.path,
                                        custom_chat_template=roles.model.custom_chat_template,
                                        trust_remote_code=roles.model.trust_remote_code)
        self.train_data = load_rl_dataset(cfg.data.train_files, self.tokenizer, cfg.data)
        self.val_data = load_rl_dataset(cfg.data.val_files, self.tokenizer, cfg.data) if cfg.data.val_files else []
        # multi-turn: tools, loops and every sample's agent_name checked before the model loads (polyrl/agents)
        self.agents = build_agent_runner(cfg, self.tokenizer, [("data.train_files", self.train_data),
                                                               ("data.val_files", self.val_data)])
        seed = cfg.data.seed if cfg.data.seed is not None else t.seed
        batch = cfg.data.gen_batch_size or cfg.data.train_batch_size
        self.sampler = PromptSampler(self.train_data, batch, shuffle=cfg.data.shuffle, seed=seed)
        self.total_steps = len(self.sampler) * t.total_epochs
        if t.total_training_steps is not None:  # verl: an explicit step count wins over total_epochs
            self.total_steps = t.total_training_steps

        # several processes keep the full policy off the GPUs (FSDP2 moves each rank's shards there; the native
        # engine copies its bf16 weights from the host replica): a full fp32 replica per GPU would crowd out the
        # engine (memory.copies_bytes counts the shard only). The hf engine generates with the replica itself.
        # A tensor-parallel engine (an off-policy pool's replicas too) streams its slices from that host copy.
        host = (self.dist.is_distributed and roles.rollout.name == "native") \
            or ((roles.rollout.tensor_model_parallel_size or 1) > 1 and self.ROLE != "train")
        model = load_policy(roles.model, device=torch.device("cpu") if host else self.device)
        check_router_replay(roles.actor.router_replay.mode, roles.rollout.enable_rollout_routing_replay,
                            bool(find_routers(model)), roles.actor.ulysses_sequence_parallel_size)
        # every auto (None) memory key: token budgets, checkpointing, compile, engine share (training/memory.py)
        made = plan_memory(cfg, model, self.device, dist=self.dist, log=print if self.dist.is_rank0 else lambda _: None,
                           role=self.ROLE)
        if self.dist.is_distributed:  # this rank's engine gets a full replica; the trained copy is FSDP2-sharded
            from polyrl.distributed.parallelize import parallelize

            if roles.rollout.tensor_model_parallel_size > 1:
                # a TP engine streams its slices from the FSDP shards, so the full copy below only serves as the
                # reference's and HF export's template: keep it in host memory (FSDP2 moves the shards to the GPU)
                model.to("cpu")
                torch.cuda.empty_cache()
            self.rollout_replica = copy.deepcopy(model)
            parallelize(model, self.dist.mesh, roles.actor.fsdp_config, self.device)
        self.model = model
        self.export_dtype = export_dtype(t.export_dtype, roles.model.path, trained=next(model.parameters()).dtype)
        optim = roles.actor.optim
        params = param_groups(model)  # polyrl.distributed: sharded and replicated parameters in separate groups
        optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                      weight_decay=optim.weight_decay)
        warmup = optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else \
            int(optim.lr_warmup_steps_ratio * self.total_steps)
        scheduler = make_scheduler(optimizer, total_steps=self.total_steps, warmup_steps=warmup,
                                   kind=optim.lr_scheduler_type, min_lr_ratio=optim.min_lr_ratio,
                                   num_cycles=optim.num_cycles)
        fwd = ForwardSettings.from_config(roles.model, roles.actor)
        fwd.pack_on_cpu = cpu_packs_shared_prompts(cfg, self.device, self.dist.data.world_size,
                                                   log=print if self.dist.is_rank0 else lambda _: None)
        self.actor = Actor(model, optimizer, scheduler, dp=self.dist, fwd=fwd)
        self.ref_model = self._make_reference(model)
        self.oom = OOMGuard(cfg, distributed=self.dist.is_distributed, optimizers=[optimizer])  # trainer/oom.py
        # an auto token budget is checked against the first update's measured peak (learner/memory.py)
        self.calibration = FirstUpdateCalibration(
            cfg, self.device, optimizer, self.dist, log=print if self.dist.is_rank0 else lambda _: None,
            enabled=any(c.key.endswith("actor.ppo_max_token_len_per_gpu") for c in made))
        self.critic = self._make_critic() if cfg.critic.enable else None
        self.kl_ctrl = make_kl_controller(**vars(cfg.algorithm.kl_ctrl)) if cfg.algorithm.use_kl_in_reward else None

        self.engine = self._make_engine()
        self.stop_ids = self._stop_token_ids()
        self.reward = self._make_reward()
        self.profiler = Profiler(cfg.global_profiler, {"actor": roles.actor.profiler, "ref": roles.ref.profiler,
                                                        "rollout": roles.rollout.profiler})
        self.timer = StepTimer(hooks=[self.profiler])
        shuffle_seed = roles.actor.data_loader_seed if roles.actor.data_loader_seed is not None else t.seed
        self.generator = torch.Generator().manual_seed(shuffle_seed)  # mini-batch shuffles (actor.shuffle)
        self.global_step = 0
        self._bar = None  # the progress bar while fit() runs (log lines are written with it lifted)
        if self.dist.is_rank0:
            self._write_env()
        self.tracker = self.open_tracker()
        self.resume()

    # ------------------------------------------------------------------------------------------------ setup helpers
    def _make_reference(self, model):
        cfg = self.cfg
        if not (cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward):
            return None
        from peft import PeftModel

        if isinstance(model, PeftModel):
            return "disable_adapter"  # the reference is the base model: adapters switched off
        ref = copy.deepcopy(self.rollout_replica if self.dist.is_distributed else model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        if self.dist.is_distributed:
            from polyrl.distributed.parallelize import parallelize_frozen

            parallelize_frozen(ref, self.dist.mesh, self.cfg.actor_rollout_ref.ref.fsdp_config, self.device)
        return ref

    def _make_reward(self):
        """The reward: a reward model (rewards/model_reward.py) then the rule or custom function; the function in a Ray
        actor apart from the trainer (rewards/remote.py); or the function here."""
        cfg = self.cfg
        rm = cfg.reward_model
        overlong = rm.overlong_buffer
        if "overlong_buffer_cfg" in rm.reward_kwargs:  # verl's newer spelling
            for k, v in rm.reward_kwargs["overlong_buffer_cfg"].items():
                setattr(overlong, k, v)
        model_rm = resolve_reward_model(cfg, self.dist.data.world_size)
        if model_rm is not None:
            return build_model_reward(model_rm, cfg, overlong=overlong, device=self.device, dist=self.dist)
        if rm.launch_reward_fn_async or rm.enable_resource_pool:
            from polyrl.rewards.remote import RemoteReward, reward_gpus_per_rank

            gpus = 0.0
            if rm.enable_resource_pool:  # GPUs of its own, shared by this node's ranks
                gpus = reward_gpus_per_rank(rm.n_gpus_per_node, "reward_model.n_gpus_per_node")
            return RemoteReward(cfg.custom_reward_function, overlong, cfg.data.max_response_length, num_gpus=gpus)
        return RewardManager(build_reward_fn(cfg.custom_reward_function), overlong_buffer=overlong,
                             max_response_length=cfg.data.max_response_length)

    def _make_critic(self):
        from polyrl.models.loader import load_causal_lm
        from polyrl.learner.critic import Critic, ValueModel

        c, roles = self.cfg.critic, self.cfg.actor_rollout_ref
        lm = load_causal_lm(c.model.path or roles.model.path, key="critic.model.path",
                            trust_remote_code=c.model.trust_remote_code, override_config=c.model.override_config,
                            external_lib=c.model.external_lib)
        model = ValueModel(lm)
        if c.model.enable_gradient_checkpointing:
            model.body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.dist.is_distributed:  # sharded like the actor, over the same mesh (FSDP2 moves the shards)
            from polyrl.distributed.parallelize import parallelize

            parallelize(model, self.dist.mesh, c.model.fsdp_config, self.device)
        else:
            model.to(self.device)
        opt = torch.optim.AdamW(param_groups(model), lr=c.optim.lr, betas=tuple(c.optim.betas), eps=c.optim.eps,
                                weight_decay=c.optim.weight_decay)
        shards = self.dist.data.world_size
        mini = mini_batch_per_gpu(c.ppo_mini_batch_size or roles.actor.ppo_mini_batch_size, roles.rollout.n, shards)
        micro = micro_batch_per_gpu(c.ppo_micro_batch_size_per_gpu, c.ppo_micro_batch_size, shards) or \
            micro_batch_per_gpu(c.forward_micro_batch_size_per_gpu, c.forward_micro_batch_size, shards) or \
            micro_batch_per_gpu(roles.actor.ppo_micro_batch_size_per_gpu, roles.actor.ppo_micro_batch_size, shards) or mini
        return Critic(model, opt, cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode,
                      grad_clip=c.grad_clip, ppo_epochs=c.ppo_epochs, mini_batch_size=mini,
                      micro_batch_size=min(micro, mini), dp=self.dist.data)

    def _make_engine(self):
        cfg = self.cfg
        r = cfg.actor_rollout_ref.rollout
        tp = {}
        if r.tensor_model_parallel_size > 1:  # replicas of N consecutive ranks (rollout/native/tensor_parallel.py)
            from polyrl.rollout.native.tensor_parallel import TPGroup

            tp = {"tp": TPGroup.consecutive(r.tensor_model_parallel_size)}
        return make_rollout(r, self._rollout_model(), pad_token_id=self.tokenizer.pad_token_id, device=self.device,
                            max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length, **tp)

    def _rollout_model(self):
        """The engine's source of weights: on CPU/hf the actor module itself (shared, nothing to copy); with several
        processes this rank's full replica, refilled tensor by tensor after each update."""
        if self.cfg.actor_rollout_ref.rollout.tensor_model_parallel_size > 1:  # no full replica on any GPU
            from polyrl.distributed.weights import GatheredModel, full_tensors_by_layer

            return GatheredModel(self.model, lambda: full_tensors_by_layer(merged_state_dict(self.model).items()))
        return self.rollout_replica if self.dist.is_distributed else self.model

    def _stop_token_ids(self) -> tuple[int, ...]:
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif isinstance(gen_eos, (list, tuple)):
            ids.update(gen_eos)
        ids.discard(None)
        return tuple(sorted(ids))

    def _write_env(self) -> None:
        try:
            from polyrl.report.env import collect_env

            env = collect_env(self.model)
        except Exception as e:  # the run must not die for a missing version string
            env = {"error": repr(e)}
        (self.run_dir / "env.json").write_text(json.dumps(env, indent=1, default=str))

    # ------------------------------------------------------------------------------------------------ the RL step
    def step(self) -> dict[str, float]:
        cfg = self.cfg
        timer = self.timer
        metrics: dict[str, float] = {}
        self.profiler.step_start(self.global_step + 1)
        t_step = time.perf_counter()
        with timer.stage("step"):
            # with Ulysses SP, the first rank of each SP group shares its rollouts (engines need not agree bitwise)
            samples, batch, index, gen_metrics = self.dist.share_with_sp_group(self._collect_batch(timer))
            metrics.update(gen_metrics)
            s = self._update_settings(batch)
            rc = cfg.algorithm.rollout_correction
            if not s.old_from_current and not rc.bypass_mode:
                if "old_log_probs" not in batch:  # off-policy batches bring their behaviour policy's (async_ppo.py)
                    with timer.stage("old_log_prob"):
                        batch["old_log_probs"] = self.oom.run(
                            "old_log_prob", lambda: self._old_logprobs(self.model, batch, s),
                            ctx=StageContext(batch, s.micro_batch_size, engine=self.engine))
                if batch["old_log_probs"] is not batch["rollout_log_probs"]:  # async_ppo's engine-behaviour batches
                    metrics.update(rollout_logprob_gap(batch["rollout_log_probs"], batch["old_log_probs"],
                                                       batch["response_mask"],
                                                       with_kl=self.actor.fwd.routing is not None))
            if rc.bypass_mode:  # two policies: the rollout's log-probs stand in for pi_old
                batch["old_log_probs"] = batch["rollout_log_probs"]
            elif rc.enabled:
                with timer.stage("rollout_correction"):
                    weights, batch["response_mask"], rc_metrics = compute_rollout_correction(
                        batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], rc)
                if weights is not None:
                    batch["rollout_is_weights"] = weights
                metrics.update(rc_metrics)
            if cfg.algorithm.adv_estimator in _NEEDS_SUM_PI_SQUARED:
                with timer.stage("sum_pi_squared"):
                    batch["sum_pi_squared"] = compute_sum_pi_squared(
                        self.model, batch, temperature=s.temperature, micro_batch_size=s.micro_batch_size)
            if self.ref_model is not None:
                with timer.stage("ref"):
                    batch["ref_log_probs"] = self.oom.run(
                        "ref", lambda: self._ref_logprobs(batch, s),
                        ctx=StageContext(batch, s.micro_batch_size, engine=self.engine))
            if self.critic is not None:
                with timer.stage("values"):
                    batch["values"] = self.critic.compute_values(batch)
            with timer.stage("adv"):
                metrics.update(self._advantages(batch, index))
            rollout_batch = batch  # as generated on this rank: its groups match `index` (for data metrics)
            if self.dist.data.is_distributed and cfg.trainer.balance_batch:
                with timer.stage("balance_batch"):  # equal tokens per rank within each mini-batch
                    batch, balance_metrics = balance_across_ranks(batch, s.mini_batch_size, self.dist.data)
                metrics.update(balance_metrics)
            if self.critic is not None:
                with timer.stage("update_critic"):
                    metrics.update(self.critic.update(batch))
                    metrics["critic/vf_explained_var"] = explained_variance(batch["values"], batch["returns"],
                                                                            batch["response_mask"])
            with timer.stage("update_actor"):
                if self.global_step >= cfg.trainer.critic_warmup:
                    # a retry (trainer/oom.py) re-reads the shrunk budget and resumes after the applied mini-batches
                    ctx = StageContext(batch, s.micro_batch_size, model=self.model, engine=self.engine,
                                       progress=lambda: self.actor.mini_batches_applied)
                    with self.calibration.around_update():
                        metrics.update(self.oom.run("update_actor", lambda: self.actor.update(
                            batch, self._update_settings(batch, skip_mini_batches=ctx.done),
                            generator=self.generator), ctx=ctx, generators=[self.generator]))
            if s.old_from_current:
                metrics["training/old_log_prob_source_current"] = 1.0
            with timer.stage("update_weights"):
                self.engine.update_weights(self._weights_for_rollout())
        self.global_step += 1
        self.profiler.step_end(self.global_step)
        timings = timer.pop()
        metrics.update(timings)
        metrics.update(data_metrics(rollout_batch, max_response_length=cfg.data.max_response_length, index=index))
        step_time = time.perf_counter() - t_step
        num_tokens = int(rollout_batch["attention_mask"].sum())
        n_gpus = max(1, torch.cuda.device_count()) if self.device.type == "cuda" else 1
        if self.dist.is_distributed:  # per-rank numbers -> the job's (counts summed, extremes kept, rest averaged)
            n_gpus = self.dist.world_size
            num_tokens = int(self.dist.data.all_reduce(torch.tensor(num_tokens, device=self.device)))
            step_time = float(self.dist.all_reduce(torch.tensor(step_time, device=self.device), op="max"))
        metrics["perf/total_num_tokens"] = num_tokens
        metrics["perf/time_per_step"] = step_time
        metrics["perf/throughput"] = num_tokens / (step_time * n_gpus)
        if self.device.type == "cuda":
            metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
            metrics["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
        metrics["training/global_step"] = self.global_step
        metrics["training/epoch"] = self.sampler.epoch
        return dp_data.merge_step_metrics(self.dist.all_gather_object(metrics)) if self.dist.is_distributed \
            else metrics

    def _update_settings(self, batch, skip_mini_batches: int = 0) -> UpdateSettings:
        a, r = self.cfg.actor_rollout_ref.actor, self.cfg.actor_rollout_ref.rollout
        B = batch["responses"].shape[0]
        shards = self.dist.data.world_size
        mini = min(B, mini_batch_per_gpu(a.ppo_mini_batch_size, r.n, shards))
        micro = micro_batch_per_gpu(a.ppo_micro_batch_size_per_gpu, a.ppo_micro_batch_size, shards) or mini
        temperature = r.temperature if r.do_sample and r.temperature > 0 else 1.0
        alg = self.cfg.algorithm
        # pi_old must exist before the update for rollout correction (decoupled) and OTB; bypass reads the rollout's
        needs_old = alg.rollout_correction.enabled or alg.adv_estimator in _NEEDS_SUM_PI_SQUARED
        return UpdateSettings.from_config(
            a, max_response_length=self.cfg.data.max_response_length, mini_batch_size=mini,
            micro_batch_size=min(micro, mini), temperature=temperature,
            old_from_current=(a.ppo_epochs == 1 and mini >= B and not alg.use_kl_in_reward and not needs_old),
            rollout_correction=alg.rollout_correction if alg.rollout_correction.bypass_mode else None,
            skip_mini_batches=skip_mini_batches)

    def _old_logprobs(self, model, batch, s: UpdateSettings) -> torch.Tensor:
        """pi_old's log-probs; with router_replay.mode=R2 also the routes this pass chose, into batch["routed_experts"]
        for the update to replay."""
        r = self.cfg.actor_rollout_ref.rollout
        micro = micro_batch_per_gpu(r.log_prob_micro_batch_size_per_gpu, r.log_prob_micro_batch_size,
                                    self.dist.data.world_size)
        r2 = self.cfg.actor_rollout_ref.actor.router_replay.mode == "R2"
        out = compute_logprobs(model, batch, temperature=s.temperature, micro_batch_size=micro or s.micro_batch_size,
                               max_token_len=r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None,
                               fwd=self.actor.fwd, dp=self.dist, record_routes=r2)
        if r2:
            out, batch["routed_experts"] = out
        return out

    def _ref_logprobs(self, batch, s: UpdateSettings) -> torch.Tensor:
        ref = self.cfg.actor_rollout_ref.ref
        micro = micro_batch_per_gpu(ref.log_prob_micro_batch_size_per_gpu, ref.log_prob_micro_batch_size,
                                    self.dist.data.world_size)
        kw = dict(temperature=s.temperature, micro_batch_size=micro or s.micro_batch_size,
                  max_token_len=ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz else None,
                  fwd=self.actor.fwd, dp=self.dist)
        if self.ref_model == "disable_adapter":
            with self.model.disable_adapter():
                return compute_logprobs(self.model, batch, **kw)
        return compute_logprobs(self.ref_model, batch, **kw)

    def _advantages(self, batch, index) -> dict[str, float]:
        alg = self.cfg.algorithm
        metrics: dict[str, float] = {}
        if alg.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_in_reward(batch["token_level_scores"], batch["old_log_probs"],
                                                     batch["ref_log_probs"], batch["response_mask"], self.kl_ctrl,
                                                     alg.kl_penalty)
            metrics.update({k: float(v) for k, v in kl_metrics.items()})
        else:
            rewards = batch["token_level_scores"]
        batch["token_level_rewards"] = rewards
        components = batch.pop("reward_components", None)
        adv, ret = compute_advantage(alg.adv_estimator, token_level_rewards_BT=rewards,
                                     response_mask_BT=batch["response_mask"], index=index, gamma=alg.gamma,
                                     lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
                                     reward_baselines_B=batch.get("reward_baselines"),
                                     values_BT=batch.get("values"), old_log_probs_BT=batch.get("old_log_probs"),
                                     sum_pi_squared_BT=batch.pop("sum_pi_squared", None),
                                     rollout_is_weights_BT=batch.get("rollout_is_weights"),
                                     reward_components_KB=None if components is None else components.T,
                                     reward_weights_K=alg.gdpo_reward_weights,
                                     # several processes: whiten with the whole batch's statistics, as one process
                                     whiten=whiten_over(self.dist.data.all_reduce) if self.dist.data.is_distributed
                                     else masked_whiten)
        batch["advantages"], batch["returns"] = adv, ret
        return metrics

    def _weights_for_rollout(self):
        if getattr(self.engine, "model", None) is self.model:
            return []  # the engine generates with the actor module itself: already up to date
        # what training changed: under LoRA the merged adapted weights, never the frozen base the engine was built with
        named = merged_state_dict(self.model, trained_only=True).items()
        if self.cfg.actor_rollout_ref.rollout.tensor_model_parallel_size > 1:  # a layer at a time; each rank
            from polyrl.distributed.weights import full_tensors_by_layer  # keeps its TP slice

            return full_tensors_by_layer(named)
        if self.dist.is_distributed:  # all-gather one tensor at a time into this rank's replica
            from polyrl.distributed.weights import full_tensors

            return full_tensors(named)
        return named

    # ------------------------------------------------------------------------------------------------ validation
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        if not self.val_data:
            return {}
        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        temperature = vk.temperature if vk.do_sample else 0.0
        sampling = SamplingParams(n=vk.n, temperature=temperature, top_k=vk.top_k, top_p=vk.top_p,
                                  max_new_tokens=self.cfg.actor_rollout_ref.rollout.response_length,
                                  stop_token_ids=self.stop_ids)
        with self.timer.stage("testing"):
            val = self.val_data
            if self.dist.is_distributed:  # each rank validates a slice; gathered below
                val = [val[i] for i in dp_data.shard_evenly(len(val), self.dist.rank, self.dist.world_size)]
            out = self.oom.run("gen", lambda: self._rollout(val, sampling), ctx=StageContext(engine=self.engine))
            scores, extras, texts = self._score(val, out, tool_rewards=False)  # accuracy: the reward function's
        rows = [val[pi] for pi in out.prompt_index]
        preds = [t.strip() for t in texts]
        infos = {"reward": scores, **extras}
        if "acc" not in infos:
            infos["acc"] = [float(s >= 1.0) for s in scores] if self._binary_rewards(scores) else scores
        infos.setdefault("pred", preds)  # majority vote (maj@N) over the decoded answers
        t = self.cfg.trainer
        if t.validation_data_dir:
            self._dump_generations(t.validation_data_dir, val, out, texts, scores)
        for i in range(min(t.log_val_generations, len(preds))):  # as the model saw them: special tokens included
            prompt = self.tokenizer.decode(val[out.prompt_index[i]].prompt_ids, skip_special_tokens=False)
            response = self.tokenizer.decode(out.token_ids[i], skip_special_tokens=False)
            with bar_lifted(self._bar):
                print(f"[val {i}] prompt={prompt!r} response={response!r} score={scores[i]:.3f}", flush=True)
        sources, uids = [s.data_source for s in rows], [str(s.index) for s in rows]
        if self.dist.is_distributed:
            sources, uids, infos = dp_data.gather_validation(self.dist, sources, uids, infos)
        metrics = process_validation_metrics(sources, uids, infos)
        metrics.update(self.timer.pop())
        return metrics

    @staticmethod
    def _binary_rewards(scores) -> bool:
        return all(s in (0.0, 1.0) for s in scores)

    # ------------------------------------------------------------------------------------------------ the loop
    # fit(), checkpoints and resume: polyrl.trainer.core.TrainerCore
    def exports_every_save(self) -> bool:
        return "hf_model" in self.cfg.actor_rollout_ref.actor.checkpoint.save_contents

    def after_fit(self) -> None:
        if self.dist.is_rank0:
            self._write_report()

    def _write_report(self) -> None:
        """report.html beside metrics.jsonl; needs the `file` logger (the report reads metrics.jsonl alone)."""
        if self.dist.is_distributed and self.dist.rank != 0:
            return
        if not (self.run_dir / "metrics.jsonl").is_file():
            print("polyrl: no report (add 'file' to trainer.logger to get metrics.jsonl and report.html)", flush=True)
            return
        from polyrl.report import build_report

        path = build_report(str(self.run_dir))
        print(f"polyrl: report written to {path}", flush=True)
