"""The verl-shaped config tree of `polyrl train`, composed from each component's own dataclasses.

Every key a verl user passes to `main_ppo` has the same name here. Keys whose feature needs hardware or software that
is not available are refused by `polyrl.trainer.checks`, never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from polyrl.algorithms.rollout_correction import RolloutCorrectionConfig
from polyrl.data.config import DataConfig
from polyrl.models.config import ModelConfig
from polyrl.rewards.config import CustomRewardConfig, RewardConfig, RewardModelConfig
from polyrl.rollout.config import RolloutConfig
from polyrl.trainer.async_config import AsyncTrainingConfig, RolloutPoolConfig
from polyrl.trainer.core import LoopConfig
from polyrl.learner.config import ActorConfig, CriticConfig, RefConfig
from polyrl.utils.profiler import GlobalProfilerConfig


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    """Actor, reference and rollout share the devices (on-policy). False: the one-step off-policy pipeline, rollout
    on GPUs of its own (rollout.*, async_training.*; trainer/async_ppo.py)."""
    nccl_timeout: int = 600
    """Collective timeout in seconds."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained policy."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy (built only when a KL term needs it)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The generation engine."""


@dataclass
class KLControlConfig:
    type: str = "fixed"
    """fixed or adaptive."""
    kl_coef: float = 0.001
    """Initial (or fixed) KL-in-reward coefficient."""
    horizon: int = 10000
    """Adaptive controller horizon."""
    target_kl: float = 0.1
    """Adaptive controller target KL."""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop prompt groups whose metric has zero variance."""
    metric: str | None = None
    """Metric to filter on: acc, score or seq_reward."""
    max_num_gen_batches: int = 0
    """Max generation batches per step while filling the batch; 0 is unlimited."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """gae, grpo(_vectorized), rloo(_vectorized), reinforce_plus_plus(_baseline), remax, opo, gpg, grpo_passk, gdpo,
    optimal_token_baseline, tir_optimal_token_baseline."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group std (False = Dr.GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract a KL penalty from the token rewards."""
    kl_penalty: str = "kl"
    """Estimator of the in-reward KL."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """KL-in-reward controller."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
    use_pf_ppo: bool = False
    """PF-PPO reweighting (not implemented: refused)."""
    pf_ppo: dict = field(default_factory=dict)
    """PF-PPO settings."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Off-policy rollout correction: IS weights, rejection, bypass mode (polyrl/algorithms/rollout_correction.py)."""
    gdpo_reward_keys: list[str] | None = None
    """gdpo: the reward function's extra keys, one per reward component normalised on its own."""
    gdpo_reward_weights: list[float] | None = None
    """gdpo: weight of each component in gdpo_reward_keys (default 1 each)."""


@dataclass
class CheckpointConfigT:
    async_save: bool = False
    """Save in the background (not implemented)."""


@dataclass
class TrainerConfig(LoopConfig):
    """The LLM loop's keys beyond the shared ones (trainer/core.py LoopConfig)."""

    total_epochs: int = 30
    """Passes over the training data."""
    log_val_generations: int = 0
    """Validation generations to print."""
    rollout_data_dir: str | None = None
    """Write each step's generations as jsonl here."""
    validation_data_dir: str | None = None
    """Write validation generations as jsonl here."""
    export_dtype: str = "auto"
    """Dtype of the HF export beside the final checkpoint: auto (the input model's weights' dtype), float32, bfloat16
    or float16."""
    esi_redundant_time: float = 0
    """verl elastic-instance setting (no effect here)."""
    critic_warmup: int = 0
    """Steps that train only the critic."""
    default_hdfs_dir: str | None = None
    """Remote copy of checkpoints (not supported: must stay null)."""
    del_local_ckpt_after_load: bool = False
    """Delete local checkpoints after loading."""
    max_critic_ckpt_to_keep: int | None = None
    """Keep at most this many critic checkpoints."""
    ray_wait_register_center_timeout: int = 300
    """Ray registration timeout."""
    balance_batch: bool = True
    """Re-deal each mini-batch's rows so data-parallel ranks train on equal token counts (no effect in one process)."""
    seed: int = 1
    """Global seed (model init, sampling, shuffling)."""
    use_legacy_worker_impl: str = "auto"
    """verl worker implementation switch (no effect here)."""


@dataclass
class PPOConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and lengths."""
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    """Policy, reference and rollout."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (gae)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Reward settings (verl's legacy layout)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """verl 0.9's layout of the reward model (reward.reward_model.*)."""
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    """A user reward function from a file."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and KL-in-reward."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, logging and checkpoints."""
    rollout: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    """The rollout GPUs of the off-policy pipeline (actor_rollout_ref.hybrid_engine=False)."""
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    """Staleness and weight streaming of the off-policy pipeline."""
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
    """Profiler (torch, torch_memory, nsys)."""
