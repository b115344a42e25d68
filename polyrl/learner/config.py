"""`actor_rollout_ref.{actor,ref}.*` and `critic.*`: how the trained models are optimised and batched."""

from __future__ import annotations

from dataclasses import dataclass, field

from polyrl.utils.profiler import RoleProfilerConfig


def mini_batch_per_gpu(prompts: int, n: int, num_data_shards: int) -> int:
    """Sequences of one mini-batch on each data shard: verl's ppo_mini_batch_size counts prompts, each with n
    samples, split over the data shards."""
    return prompts * n // num_data_shards


def micro_batch_per_gpu(per_gpu: int | None, deprecated_global: int | None, num_data_shards: int) -> int | None:
    """verl's pair of micro-batch keys as sequences per GPU: the `*_per_gpu` key, else the deprecated global one
    divided over the data shards (what verl's workers do); None when neither is set. The trainer and its checks both
    call this, so they agree."""
    if per_gpu is not None:
        return per_gpu
    return None if deprecated_global is None else deprecated_global // num_data_shards


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate (AdamW)."""
    lr_warmup_steps: int = -1
    """Warmup steps; -1 derives them from lr_warmup_steps_ratio."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup as a fraction of the total training steps."""
    total_training_steps: int = -1
    """verl sets it from the data; polyrl's schedule counts the trainer's steps (trainer.total_training_steps or the
    epochs), so it must stay -1."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    lr_scheduler_type: str = "constant"
    """constant or cosine (both with linear warmup)."""
    warmup_style: str | None = None
    """Deprecated alias of lr_scheduler_type."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr."""
    num_cycles: float = 0.5
    """Cosine cycles (0.5 = half a cosine down to min_lr)."""
    clip_grad: float | None = None
    """Alias of actor.grad_clip (verl's newer name)."""
    optimizer: str = "AdamW"
    """Optimizer class; AdamW is the one implemented."""


@dataclass
class FSDPConfig:
    wrap_policy: dict = field(default_factory=dict)
    """verl's FSDP wrap policy; polyrl shards per transformer block."""
    param_offload: bool = False
    """Keep parameters in CPU memory between uses (FSDP2 CPU offload; multi-GPU path)."""
    optimizer_offload: bool = False
    """Keep optimizer state in CPU memory (FSDP2 CPU offload; multi-GPU path)."""
    offload_policy: bool | None = None
    """FSDP2 CPUOffloadPolicy for params, grads and optimizer state; None: auto, on for the actor (several GPUs) when
    its sharded parameters, gradients and AdamW state cannot fit the GPUs (learner/memory.py), else off."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward."""
    fsdp_size: int = -1
    """Shard group size; -1 shards over all ranks."""
    forward_prefetch: bool = False
    """FSDP2 explicit forward prefetch: each block's forward starts the next block's all-gather (several processes;
    distributed/parallelize.py). Off by default: 0.98x on 2 H100s at 1.5B (benchmarks/history.jsonl, 2026-11-25)."""
    model_dtype: str = "fp32"
    """Dtype the model is built and trained in (verl's name for model.dtype): a non-default value sets model.dtype;
    the default fp32 defers to model.dtype."""
    dtype: str = "bfloat16"
    """Compute dtype for forward/backward on GPU (autocast); CPU computes in float32."""
    use_torch_compile: bool = False
    """torch.compile the model's blocks."""
    use_orig_params: bool = False
    """FSDP1 flag, accepted for compatibility."""
    mixed_precision: dict = field(default_factory=dict)
    """verl's FSDP mixed-precision block (param_dtype/reduce_dtype/buffer_dtype)."""
    strategy: str | None = None
    """Alias of the role's strategy."""

    @property
    def cpu_offload(self) -> bool:
        """Any of the three offload switches: FSDP2's CPUOffloadPolicy (it moves parameters, gradients and optimizer
        state together)."""
        return self.param_offload or self.optimizer_offload or self.offload_policy


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    """Policy loss: vanilla, gspo, gpg, clip_cov, kl_cov, sapo, geo_mean, cispo, dro, dppo_tv, dppo_kl."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of tokens clipped."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance window."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the covariance window."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of tokens with a KL penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: KL coefficient."""
    dro_beta: float = 0.1
    """dro: weight of the quadratic penalty 0.5 * beta * (log pi - log pi_old)^2 (must be > 0)."""


@dataclass
class RouterReplayConfig:
    mode: str = "disabled"
    """MoE routing replay (polyrl/models/moe.py): disabled; R2 (the update routes tokens as the old-log-prob pass
    did); R3 (the trainer routes tokens as the rollout did; needs rollout.enable_rollout_routing_replay=True)."""


@dataclass
class CheckpointContents:
    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """What a checkpoint holds: model, optimizer, extra (scheduler, RNG, data position), hf_model."""
    load_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """What a resume loads."""
    async_save: bool = False
    """Save in a background thread (not implemented: saves are synchronous and atomic)."""


@dataclass
class ActorConfig:
    strategy: str = "fsdp2"
    """Training backend: fsdp or fsdp2 (both map to polyrl's FSDP2 engine; one process = plain data-parallel-free)."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (multiplied by rollout.n)."""
    ppo_micro_batch_size: int | None = None
    """Deprecated global micro batch; use ppo_micro_batch_size_per_gpu."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Sequences per forward/backward on each GPU."""
    use_dynamic_bsz: bool | None = None
    """Cut micro-batches by token budget instead of sequence count; None (auto): on unless a micro-batch size is set."""
    ppo_max_token_len_per_gpu: int | None = None
    """Token budget per micro-batch with use_dynamic_bsz (packed: real tokens); None: auto from free memory (memory.py)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    clip_ratio: float = 0.2
    """PPO clip epsilon (both sides unless low/high are set)."""
    clip_ratio_low: float | None = None
    """Lower clip epsilon; defaults to clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip epsilon (DAPO clip-higher: 0.28); defaults to clip_ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for negative advantages (dppo_tv/dppo_kl: truncation of the detached ratio)."""
    tau_pos: float = 1.0
    """sapo: gate temperature for positive-advantage tokens."""
    tau_neg: float = 1.05
    """sapo: gate temperature for non-positive-advantage tokens."""
    loss_agg_mode: str = "token-mean"
    """token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm."""
    loss_scale_factor: float | None = None
    """Divisor for seq-mean-token-sum-norm (defaults to the max response length)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient."""
    calculate_entropy: bool = True
    """Log actor/entropy (costs one extra reduction per token)."""
    use_kl_loss: bool = False
    """Add KL(actor || ref) to the loss (needs the reference model)."""
    kl_loss_coef: float = 0.001
    """KL loss coefficient."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: kl/k1, abs, mse/k2, low_var_kl/k3 (append + for a k2 straight-through gradient)."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    shuffle: bool = False
    """Shuffle sequences between PPO epochs."""
    data_loader_seed: int | None = None
    """Seed of the mini-batch shuffle (actor.shuffle); None: trainer.seed."""
    use_torch_compile: bool | None = None
    """torch.compile each decoder layer (+26% update tok/s on H200, NOTES_training.md); None: auto, on with CUDA
    where a step's update is big enough to repay a ~20 s cold compile (learner/memory.py `compile_choice`)."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence parallel degree (needs as many GPUs)."""
    entropy_from_logits_with_chunking: bool = True
    """polyrl always computes log-probs and entropy in LM-head chunks (learner/logprobs.py); False is refused."""
    entropy_checkpointing: bool = True
    """polyrl always recomputes each chunk's logits in backward (learner/logprobs.py); False is refused."""
    use_fused_kernels: bool = False
    """verl's fused log-prob kernels: refused (polyrl's chunked log-probs play this role; no extra kernel)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy-loss variant and its parameters."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """MoE routing replay (verl's keys)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding, offload and precision."""
    checkpoint: CheckpointContents = field(default_factory=CheckpointContents)
    """What checkpoints hold."""
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    """Per-role profiler settings (see global_profiler)."""


@dataclass
class RefConfig:
    strategy: str = "fsdp2"
    """Backend of the reference model."""
    log_prob_micro_batch_size: int | None = None
    """Deprecated global form of log_prob_micro_batch_size_per_gpu."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Sequences per reference forward."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Cut reference micro-batches by token budget; None: as the actor, unless a micro-batch size is set."""
    log_prob_max_token_len_per_gpu: int | None = None
    """Token budget per reference micro-batch (dynamic_batch.py); None: auto from free memory (memory.py)."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses degree for the reference."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding and offload of the reference."""
    use_torch_compile: bool = False
    """torch.compile the reference."""
    entropy_from_logits_with_chunking: bool = True
    """The reference's log-probs are computed in LM-head chunks too; False is refused."""
    entropy_checkpointing: bool = True
    """Accepted for symmetry with the actor (the reference has no backward); False is refused."""
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    """Per-role profiler settings."""


@dataclass
class CriticModelConfig:
    path: str | None = None
    """Critic initial weights (defaults to the actor's model path)."""
    tokenizer_path: str | None = None
    """Tokenizer of the critic."""
    enable_gradient_checkpointing: bool = False
    """Recompute critic activations in backward."""
    use_remove_padding: bool = True
    """Packed critic passes."""
    lora_rank: int = 0
    """Critic LoRA rank."""
    lora_alpha: int = 16
    """Critic LoRA alpha."""
    target_modules: str | list[str] = "all-linear"
    """Critic LoRA targets."""
    trust_remote_code: bool = False
    """Allow model code from the directory."""
    override_config: dict = field(default_factory=dict)
    """HF config overrides."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the critic."""
    external_lib: str | None = None
    """Module imported before loading."""


@dataclass
class CriticConfig:
    enable: bool | None = None
    """Use a value model; None turns it on exactly for adv_estimator=gae."""
    strategy: str = "fsdp2"
    """Backend of the critic."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer."""
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """Critic model."""
    ppo_mini_batch_size: int | None = None
    """Prompts per critic step (defaults to the actor's)."""
    ppo_micro_batch_size: int | None = None
    """Deprecated global micro batch."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Sequences per critic forward/backward."""
    forward_micro_batch_size: int | None = None
    """Deprecated."""
    forward_micro_batch_size_per_gpu: int | None = None
    """Sequences per critic value forward."""
    use_dynamic_bsz: bool = False
    """Cut critic micro-batches by token budget."""
    ppo_max_token_len_per_gpu: int = 32768
    """Critic token budget per micro-batch."""
    forward_max_token_len_per_gpu: int = 32768
    """Critic token budget per value forward."""
    ppo_epochs: int = 1
    """Critic passes per batch."""
    shuffle: bool = False
    """Shuffle between critic epochs."""
    grad_clip: float = 1.0
    """Critic gradient clip."""
    cliprange_value: float = 0.5
    """Value clipping range."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the value loss."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses degree for the critic."""
    checkpoint: CheckpointContents = field(default_factory=CheckpointContents)
    """What critic checkpoints hold."""
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    """Per-role profiler settings."""
