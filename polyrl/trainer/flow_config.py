"""FlowGRPO config tree with VeRL-Omni's key names (research/flowgrpo.md §3).

`polyrl flow train KEY=VALUE ...` fills `FlowConfig` through `polyrl.config.build_config`. Batch semantics are
verl's: `data.train_batch_size` and `actor.ppo_mini_batch_size` count prompts, each prompt yields `rollout.n`
images, `ppo_micro_batch_size_per_gpu` counts images (and also sets the rollout's chunk size unless
`rollout.log_prob_micro_batch_size_per_gpu` is set: sampling and training with the same batch shapes is what lets
the ratio start at exactly 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from polyrl.algorithms.rollout_correction import RolloutCorrectionConfig
from polyrl.learner.config import FSDPConfig
from polyrl.rewards.config import JudgeConfig, RewardModelRolloutConfig
from polyrl.trainer.core import LoopConfig
from polyrl.utils.profiler import GlobalProfilerConfig


@dataclass
class FlowDataConfig:
    """Prompts."""

    train_files: str | None = None
    """Text file (one prompt per line) or parquet with a `prompt` column; null: the quickstart's digit prompts."""
    val_files: str | None = None
    """Held-out prompts, same formats; null: the quickstart's held-out set."""
    train_batch_size: int = 10
    """Prompts per RL step (each yields rollout.n images)."""
    val_batch_size: int = 20
    """Images per validation forward chunk."""
    data_source: str = "digits"
    """Name used in validation metric keys val-core/<data_source>/reward/mean@1."""
    seed: int = 0
    """Prompt-order seed."""


@dataclass
class FlowModelConfig:
    """Which model, and LoRA or full fine-tuning."""

    path: str | None = None
    """Local diffusers pipeline dir (QwenImagePipeline, StableDiffusion3Pipeline, FluxPipeline); null: quickstart model."""
    lora_rank: int = 0
    """LoRA rank; 0 trains every transformer weight (full fine-tuning, fp32 optimizer state)."""
    lora_alpha: int = 128
    """LoRA alpha (scale alpha / rank)."""
    target_modules: list[str] = field(default_factory=lambda: [
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    ])  # fmt: skip
    """Module names LoRA adapts (verl-omni's Qwen-Image list)."""
    lora_init: str = "gaussian"
    """peft init_lora_weights ("gaussian" as verl-omni, or true for Kaiming)."""
    dtype: str = "float32"
    """Transformer weight dtype: float32, bfloat16 or float16."""
    enable_gradient_checkpointing: bool | None = None
    """Recompute activations in backward (diffusers); None: auto, off until an OOM in the update turns it on."""
    cache_prompt_embeds: bool = False
    """Keep each prompt's text-encoder output for the whole run; false: encode each step's prompts at its rollout
    and reuse them in that step's training passes only (what VeRL-Omni's rollout-to-actor hand-off does)."""


@dataclass
class FlowOptimConfig:
    """AdamW."""

    lr: float = 3e-4
    """Learning rate."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    lr_warmup_steps: int = 0
    """Linear warmup over this many optimizer steps (verl's key); Adam's first sign-like steps can wreck a small model."""


@dataclass
class DiffusionLossConfig:
    """The clipped FlowGRPO objective."""

    loss_mode: str = "flow_grpo"
    """Only flow_grpo (PPO-clip on mean per-step log-probs) is implemented."""
    clip_ratio: float = 1e-4
    """Clip epsilon on exp(logp - old_logp); tiny because log-probs are element means."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to [-adv_clip_max, adv_clip_max]."""


@dataclass
class FlowActorConfig:
    """The trained policy."""

    optim: FlowOptimConfig = field(default_factory=FlowOptimConfig)
    """Optimizer."""
    ppo_mini_batch_size: int = 5
    """Prompts per optimizer step (train_batch_size / this = optimizer steps per RL step)."""
    ppo_micro_batch_size_per_gpu: int = 16
    """Images per forward/backward (also the rollout chunk size)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    diffusion_loss: DiffusionLossConfig = field(default_factory=DiffusionLossConfig)
    """Loss knobs."""
    use_kl_loss: bool = False
    """Add beta * KL(policy || reference) per trained step."""
    kl_loss_coef: float = 0.0
    """beta."""
    kl_loss_type: str = "mean"
    """mean: exact Gaussian KL on the step means; velocity: squared velocity difference (flow_grpo#198)."""
    skip_zero_adv: bool = True
    """Skip samples whose advantage is exactly 0 (zero-std groups): same loss gradient, less compute."""
    use_torch_compile: bool = False
    """torch.compile each transformer block, for the update and the rollout (fuses the DiT's modulation, norm,
    RoPE and LoRA elementwise work; GPU: on an H200 it took Qwen-Image's FlowGRPO step from 0.63 to 0.83 img/s)."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 with several processes: reshard_after_forward, fsdp_size, CPU offload, mixed_precision.reduce_dtype.
    On GPU fp32 weights compute in `dtype` (bf16) or `mixed_precision.param_dtype`, trained as fp32 (sharded with
    several processes, fp32 masters in one)."""


@dataclass
class PipelineConfig:
    """Sampling shape (VeRL-Omni's rollout.pipeline.*)."""

    height: int = 16
    """Image height in pixels."""
    width: int = 16
    """Image width in pixels."""
    num_inference_steps: int = 10
    """Denoising steps during RL rollouts (denoising reduction: fewer than validation's)."""
    true_cfg_scale: float = 1.0
    """CFG scale; > 1 runs [positive; negative] branches, both trained (Qwen-Image adds its norm rescale)."""
    negative_prompt: str = " "
    """Negative prompt for CFG."""
    max_sequence_length: int = 256
    """Prompt token limit for the text encoder."""
    guidance_scale: float = 3.5
    """Embedded guidance of guidance-distilled models (FLUX.1-dev, `guidance_embeds`); ignored by the others."""
    shift: float = 3.0
    """Time shift of the sigma grid when the model has no scheduler (the quickstart); pipelines use their own."""


@dataclass
class AlgoConfig:
    """Stochastic sampling (VeRL-Omni's rollout.algo.*)."""

    noise_level: float = 0.7
    """a in the SDE std (0.7 SD3, 0.9 FLUX, 1.2 Qwen-Image, 0.8 CPS)."""
    sde_type: str = "sde"
    """sde (Flow-GRPO), cps or dance_sde."""
    sde_window_size: int | None = 3
    """SDE window width (ODE outside it); null/0: use timestep_fraction."""
    sde_window_range: list[int] = field(default_factory=lambda: [0, 5])
    """The window [s, s+w) is drawn uniformly inside [lo, hi)."""
    timestep_fraction: float = 0.99
    """Without a window: train the first floor(steps * fraction) steps."""


@dataclass
class FlowValKwargs:
    """Validation sampling: ODE with the evaluation step count."""

    num_inference_steps: int = 20
    """Validation denoising steps."""
    noise_level: float = 0.0
    """0: deterministic ODE sampling."""
    seed: int = 1234
    """Noise seed, fixed so validations are comparable."""


@dataclass
class FlowRolloutConfig:
    """How images are sampled."""

    n: int = 8
    """Images per prompt (the GRPO group)."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Shape, steps and CFG."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """SDE settings."""
    val_kwargs: FlowValKwargs = field(default_factory=FlowValKwargs)
    """Validation sampling."""
    seed: int = 42
    """Rollout noise seed."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Images per sampling forward (the sampler records log-probs as it goes); null: the actor's micro-batch.
    Larger than the actor's when training needs a small micro-batch (no gradient checkpointing) but sampling,
    which keeps no activations, runs faster on a larger one. Other batch shapes pick other GPU kernels, so the
    ratio then starts near 1 rather than exactly at 1: watch actor/ratio_mean against the tiny clip_ratio."""
    quantization: str | None = None
    """fp8: the sampling forwards of the deterministic (ODE) steps run the transformer blocks' GEMMs in e4m3 (CPU:
    emulated); the trained steps and the update stay in the model dtype (polyrl/rollout/fp8_dit.py)."""
    fp8_trained_steps: bool = False
    """With quantization=fp8: sample the trained (SDE) steps in FP8 too, and recompute their old log-probs in the
    model dtype, which measures the gap (rollout_corr/*, training/rollout_probs_diff_*); pair with
    algorithm.rollout_correction. False: those steps sample in the model dtype and need no recompute."""


@dataclass
class FlowActorRolloutRefConfig:
    """Model, actor and rollout (the reference is the adapter-disabled or frozen model)."""

    model: FlowModelConfig = field(default_factory=FlowModelConfig)
    """Model."""
    actor: FlowActorConfig = field(default_factory=FlowActorConfig)
    """Actor."""
    rollout: FlowRolloutConfig = field(default_factory=FlowRolloutConfig)
    """Rollout."""


@dataclass
class FlowAlgorithmConfig:
    """Advantage."""

    adv_estimator: str = "flow_grpo"
    """Only flow_grpo (outcome GRPO broadcast to every trained step)."""
    norm_adv_by_std_in_grpo: bool = True
    """false: Dr.GRPO (no division by the std)."""
    global_std: bool = True
    """Divide by the whole batch's reward std instead of each group's."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """IS weights / rejection between the recomputed and the rollout's per-step log-probs (the LLM's keys; each
    trained step is one "token"); enabling it recomputes old log-probs. bypass_mode is refused."""


@dataclass
class FlowCustomRewardConfig:
    """A user reward `fn(images, prompts, metadata) -> scores` loaded from a file."""

    path: str | None = None
    """Python file defining the function."""
    name: str = "compute_score"
    """Function name in that file."""


@dataclass
class RewardPoolConfig:
    """VeRL-Omni's reward resource pool: scoring on GPUs of its own, apart from the trainer's."""

    enable: bool = False
    """Score the images with a VLM judge (rewards/vlm_judge.py), joining reward_fns as `reward_model` (weight 1
    unless reward_fns names it)."""
    model_path: str | None = None
    """The VLM judge's local directory (an image-text-to-text model such as Qwen2-VL)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The judge file: prompt template ({question}: the image's prompt, {response}: the image) and score parser."""
    rollout: RewardModelRolloutConfig = field(default_factory=RewardModelRolloutConfig)
    """The judge's decoding (HF generate): dtype, max_num_seqs images per call, response_length, sampling,
    free_cache_engine."""
    enable_resource_pool: bool = False
    """Score in a Ray actor holding n_gpus_per_node GPUs (implies async scoring; needs Ray). Start Ray with only the
    reward GPUs visible, e.g. `CUDA_VISIBLE_DEVICES=4 ray start --head --num-gpus=1`, then train on the others with
    RAY_ADDRESS=auto: Ray does not know which GPUs torchrun's ranks use."""
    n_gpus_per_node: int = 1
    """GPUs of the reward pool per node; each trainer rank's actor asks for n_gpus_per_node / ranks per node."""


@dataclass
class FlowRewardConfig:
    """Reward functions and where they run."""

    reward_fns: dict = field(default_factory=dict)
    """Weighted multi-reward, {name: weight} over the built-ins (ocr, digit_classifier); empty: the task default."""
    custom_reward_function: FlowCustomRewardConfig = field(default_factory=FlowCustomRewardConfig)
    """Custom reward by path (joins reward_fns with weight 1 when set)."""
    async_reward: bool = False
    """Score each rollout chunk in a separate process while the next chunk is generated; the last chunk is scored
    while the update's first forward runs (Qwen-Image LoRA, one H200: 0.21-0.26 s of waiting became 0.02-0.06 s)."""
    num_workers: int = 1
    """Reward worker processes when async_reward is on; each chunk is split among them, and the host's cores among
    the workers of all local processes (POLYRL_REWARD_THREADS overrides the threads per worker). With 4 processes on
    64 cores, 8 workers each (2 threads) scored 32 images per GPU in 1.6-2.0 s of waiting (Qwen-Image full FT, 4
    H200s). One process on 16 cores (Qwen-Image LoRA, one H200): 1.1 s for 16 images with 1 worker; with the core
    split, 4 workers waited 0.5 s for one chunk of 16 and 0.3 s with two chunks of 8
    (`actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8`: the first chunk is scored while the second
    samples), 8 workers (2 threads each) 0.24 s (2026-11-26). 1 stays the default, which fits any host (CI has 2
    cores)."""
    reward_model: RewardPoolConfig = field(default_factory=RewardPoolConfig)
    """Where scoring runs when it has GPUs of its own."""


@dataclass
class FlowTrainerConfig(LoopConfig):
    """The shared loop keys (trainer/core.py LoopConfig) with FlowGRPO's defaults."""

    total_training_steps: int | None = 60
    """RL steps."""
    test_freq: int = 20
    """Validate every N steps (<= 0: only before training and after the last step)."""
    project_name: str = "polyrl_flow"
    """Project name (trackers, default directories)."""
    experiment_name: str = "flow_grpo"
    """Experiment name (trackers, default directories)."""


@dataclass
class FlowConfig:
    """The whole FlowGRPO config tree."""

    data: FlowDataConfig = field(default_factory=FlowDataConfig)
    """Prompts."""
    actor_rollout_ref: FlowActorRolloutRefConfig = field(default_factory=FlowActorRolloutRefConfig)
    """Model, actor, rollout."""
    algorithm: FlowAlgorithmConfig = field(default_factory=FlowAlgorithmConfig)
    """Advantage."""
    reward: FlowRewardConfig = field(default_factory=FlowRewardConfig)
    """Rewards."""
    trainer: FlowTrainerConfig = field(default_factory=FlowTrainerConfig)
    """Loop."""
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
    """Profiler (torch, torch_memory, nsys), the same keys as `polyrl train`."""
