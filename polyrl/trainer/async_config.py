"""Keys of the one-step off-policy pipeline (trainer/async_ppo.py), named as in verl's `one_step_off_policy` recipe
(the switch `actor_rollout_ref.hybrid_engine=False`, the rollout pool `rollout.*`) and NeMo RL's async GRPO
(`max_trajectory_age_steps`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RolloutPoolConfig:
    nnodes: int = 1
    """Nodes of the rollout pool when actor_rollout_ref.hybrid_engine=False."""
    n_gpus_per_node: int = 1
    """Rollout processes (GPUs) per node when actor_rollout_ref.hybrid_engine=False, in replicas of
    actor_rollout_ref.rollout.tensor_model_parallel_size; the trainer keeps trainer.nnodes x trainer.n_gpus_per_node
    (trainer/rollout_pool.py)."""


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
    """Off-policy pipeline: weights stream to the rollout processes in buckets of at most this many MiB (and of one
    decoder layer at most)."""


def check_async(cfg) -> None:
    """Refuse pipeline settings that cannot be honoured, and pipeline keys set while the pipeline is off."""
    from polyrl.errors import ConfigError

    a, pool = cfg.async_training, cfg.rollout
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
    check_placement(cfg)
    if cfg.actor_rollout_ref.model.lora_adapter_path:  # the rollout starts from the plain base (async_ppo.py)
        raise ConfigError("actor_rollout_ref.hybrid_engine=False starts its rollout processes from the base model, "
                          "not from a saved adapter; unset actor_rollout_ref.model.lora_adapter_path (train fresh "
                          "adapters) or keep hybrid_engine=True.")
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


def check_placement(cfg) -> None:
    """The trainer and rollout pools (trainer/rollout_pool.py): whole replicas, and what a pool of more than one
    process does not do yet."""
    from polyrl.errors import ConfigError
    from polyrl.trainer.rollout_pool import Placement

    pool, t, roles = cfg.rollout, cfg.trainer, cfg.actor_rollout_ref
    for key, n in (("rollout.nnodes", pool.nnodes), ("rollout.n_gpus_per_node", pool.n_gpus_per_node),
                   ("trainer.nnodes", t.nnodes), ("trainer.n_gpus_per_node", t.n_gpus_per_node)):
        if n < 1:
            raise ConfigError(f"{key}={n} must be at least 1.")
    place = Placement.of(cfg)
    tp = place.tp
    if tp > 1 and place.num_rollout % tp:  # check_tensor_parallel names the per-node divisor
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide the "
                          f"{place.num_rollout} rollout processes; use a divisor.")
    if tp > 1 and cfg.algorithm.filter_groups.enable:
        raise ConfigError("algorithm.filter_groups.enable=True (DAPO dynamic sampling) is not supported by "
                          "tensor-parallel replicas in the off-policy pipeline yet; set "
                          "actor_rollout_ref.rollout.tensor_model_parallel_size=1 or disable it.")
    rc = cfg.algorithm.rollout_correction
    if tp > 1 and (rc.rollout_is is not None or rc.rollout_rs is not None) and not rc.bypass_mode:
        raise ConfigError("decoupled rollout correction recomputes pi_old with the full model on the rollout process, "
                          "which a tensor-parallel replica does not hold; set "
                          "algorithm.rollout_correction.bypass_mode=True or "
                          "actor_rollout_ref.rollout.tensor_model_parallel_size=1.")
    if (place.num_trainers, place.num_rollout) != (1, 1) and reward_in_own_process(cfg) and scoring_may_trail(cfg):
        raise ConfigError(
            "A reward in a process of its own (reward_model.enable_resource_pool or launch_reward_fn_async) runs in "
            f"the off-policy pipeline with one trainer and one rollout process only, not {place.num_trainers} and "
            f"{place.num_rollout}; set trainer.n_gpus_per_node and rollout.n_gpus_per_node to 1 (nnodes 1), or score "
            "in the rollout processes (enable_resource_pool=False, launch_reward_fn_async=False).")
    if place.num_trainers == place.num_replicas == 1:
        return
    what = (f"the off-policy pipeline with {place.num_trainers} trainer process(es) and {place.num_replicas} "
            f"rollout replica(s)")
    if cfg.async_training.partial_rollout and place.num_replicas > 1:
        raise ConfigError(f"async_training.partial_rollout=True keeps rows in flight in one replica's engine; run "
                          f"{what} with one replica (rollout.n_gpus_per_node=1, or equal to "
                          "actor_rollout_ref.rollout.tensor_model_parallel_size) or turn it off.")
    if cfg.algorithm.filter_groups.enable:
        raise ConfigError(f"algorithm.filter_groups.enable=True (DAPO dynamic sampling) is not supported by {what} "
                          "yet; use 1 trainer and 1 rollout process, or disable it.")
    if roles.actor.ulysses_sequence_parallel_size > 1:
        raise ConfigError(f"actor_rollout_ref.actor.ulysses_sequence_parallel_size > 1 is not supported by {what} "
                          "yet; set it to 1.")
    if place.num_trainers > 1 and cfg.data.val_files and (roles.rollout.multi_turn.enable or cfg.reward_model.enable):
        # the trainer ranks validate on their FSDP2 shards in lockstep (rollout/hf.py): agent loops and a reward
        # model make data-dependent numbers of forwards per rank
        which = "multi-turn rollouts" if roles.rollout.multi_turn.enable else "a reward model"
        raise ConfigError(f"data.val_files with {which} is not supported by {what} yet; remove data.val_files or use "
                          "1 trainer process.")
    per_trainer = cfg.data.train_batch_size // place.num_trainers
    if per_trainer < place.num_replicas:
        raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} gives each of the {place.num_trainers} "
                          f"trainer processes {per_trainer} prompts, fewer than the {place.num_replicas} rollout "
                          "replicas that generate them; raise it or use fewer replicas.")


def reward_in_own_process(cfg) -> bool:
    """Whether the reward runs in a process of its own (PPOTrainer._make_reward): a reward model on GPUs of its own
    (`enable_resource_pool`, either key layout), or the rule reward with `launch_reward_fn_async` or the legacy
    `reward_model.enable_resource_pool`."""
    from polyrl.rewards.model_reward import resolve_reward_model

    model = resolve_reward_model(cfg)
    if model is not None:
        return model.model.enable_resource_pool
    return cfg.reward_model.launch_reward_fn_async or cfg.reward_model.enable_resource_pool


def scoring_may_trail(cfg) -> bool:
    """No stage needs a batch's scores, or the rollout GPU, before the next generation, so a reward in a process of
    its own scores one batch behind it (async_ppo.scores_behind, trainer/scoring_behind.py)."""
    alg, rc = cfg.algorithm, cfg.algorithm.rollout_correction
    return not (alg.filter_groups.enable or alg.adv_estimator == "remax" or (rc.enabled and not rc.bypass_mode)
                or cfg.async_training.partial_rollout)
