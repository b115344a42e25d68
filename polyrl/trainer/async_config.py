"""Keys of the one-step off-policy pipeline (trainer/async_ppo.py), named as in verl's `one_step_off_policy` recipe
(the switch `actor_rollout_ref.hybrid_engine=False`, the rollout pool `rollout.*`) and NeMo RL's async GRPO
(`max_trajectory_age_steps`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RolloutPoolConfig:
    nnodes: int = 1
    """Nodes of the rollout pool when actor_rollout_ref.hybrid_engine=False (only 1 for now)."""
    n_gpus_per_node: int = 1
    """Rollout processes (GPUs) per node when actor_rollout_ref.hybrid_engine=False (only 1 for now); the trainer
    keeps trainer.n_gpus_per_node."""


@dataclass
class AsyncTrainingConfig:
    max_trajectory_age_steps: int = 1
    """Off-policy pipeline: how many optimizer steps older than the trained weights a batch's weights may be
    (1: batch k+1 is generated while step k trains; 0: strictly on-policy, no overlap)."""
    partial_rollout: bool = False
    """Continue unfinished sequences in the next step (not implemented: must stay False)."""
    weight_bucket_mb: int = 512
    """Off-policy pipeline: weights stream to the rollout process in buckets of at most this many MiB."""


def check_async(cfg) -> None:
    """Refuse pipeline settings that cannot be honoured, and pipeline keys set while the pipeline is off."""
    from polyrl.errors import ConfigError

    a, pool, t = cfg.async_training, cfg.rollout, cfg.trainer
    if cfg.actor_rollout_ref.hybrid_engine:
        if (a, pool) != (AsyncTrainingConfig(), RolloutPoolConfig()):
            raise ConfigError("rollout.* and async_training.* configure the off-policy pipeline, which is off; set "
                              "actor_rollout_ref.hybrid_engine=False to use them, or remove them.")
        return
    if a.partial_rollout:
        raise ConfigError("async_training.partial_rollout=True is not implemented; set it to False.")
    if a.max_trajectory_age_steps < 0:
        raise ConfigError(f"async_training.max_trajectory_age_steps={a.max_trajectory_age_steps}; use 0 (on-policy) "
                          "or more (1 overlaps generation with training).")
    if a.weight_bucket_mb < 1:
        raise ConfigError(f"async_training.weight_bucket_mb={a.weight_bucket_mb}; use at least 1.")
    if (pool.nnodes, pool.n_gpus_per_node, t.nnodes, t.n_gpus_per_node) != (1, 1, 1, 1):
        raise ConfigError("actor_rollout_ref.hybrid_engine=False runs 1 trainer and 1 rollout process for now; set "
                          "trainer.nnodes, trainer.n_gpus_per_node, rollout.nnodes and rollout.n_gpus_per_node to 1.")
    if cfg.actor_rollout_ref.model.lora_rank > 0:
        raise ConfigError("actor_rollout_ref.hybrid_engine=False does not stream LoRA adapters yet; set "
                          "actor_rollout_ref.model.lora_rank=0 or keep hybrid_engine=True.")

