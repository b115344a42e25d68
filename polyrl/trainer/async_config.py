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
    """Off-policy pipeline: rows still decoding at `partial_rollout_max_new_tokens` continue in the next generation
    call, beside the next batch's rows (trainer/partial_rollout.py); a batch ships the groups that finished."""
    partial_rollout_max_new_tokens: int | None = None
    """With partial_rollout: new tokens per row per generation call; None: half of rollout.response_length."""
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
        check_partial_rollout(cfg)
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
    rc = cfg.algorithm.rollout_correction
    engine_behaviour = a.max_trajectory_age_steps > 0 and (rc.bypass_mode or not rc.enabled)  # async_ppo.py
    if cfg.actor_rollout_ref.actor.router_replay.mode == "R2" and engine_behaviour:
        raise ConfigError("actor_rollout_ref.actor.router_replay.mode=R2 replays the routes of the trainer's "
                          "old-log-prob pass, which the off-policy pipeline skips for stale batches (their pi_old is "
                          "the engine's log-probs); use R3 with actor_rollout_ref.rollout."
                          "enable_rollout_routing_replay=True, or algorithm.rollout_correction.rollout_is to "
                          "recompute pi_old.")


def partial_rollout_cap(cfg) -> int:
    """New tokens per row per generation call with partial rollouts (`partial_rollout_max_new_tokens`, else half the
    response length)."""
    response_length = cfg.actor_rollout_ref.rollout.response_length
    return cfg.async_training.partial_rollout_max_new_tokens or max(1, response_length // 2)


def check_partial_rollout(cfg) -> None:
    from polyrl.errors import ConfigError

    a, alg = cfg.async_training, cfg.algorithm
    rc = alg.rollout_correction
    cap = a.partial_rollout_max_new_tokens
    length = cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length
    if cap is not None and not 1 <= cap <= length:
        raise ConfigError(f"async_training.partial_rollout_max_new_tokens={cap}; use 1 to the response length "
                          f"({length}), or null for half of it.")
    if rc.enabled and not rc.bypass_mode:
        raise ConfigError("async_training.partial_rollout=True trains against the engine's own log-probs (a row's "
                          "tokens come from two weight versions), which decoupled rollout correction cannot "
                          "recompute; set algorithm.rollout_correction.bypass_mode=True or turn rollout_is/rollout_rs "
                          "off.")
    if alg.filter_groups.enable or alg.adv_estimator == "remax":
        raise ConfigError("async_training.partial_rollout=True does not combine with algorithm.filter_groups or the "
                          "remax estimator yet; turn one of them off.")
