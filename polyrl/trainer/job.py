"""The job a trainer config asks for: how many processes, and the batch arithmetic that sharding over them needs.

`polyrl.distributed.launch` starts processes from plain numbers (a `Job`); this module is where the trainers'
config trees become those numbers, so the layer below never reads a trainer's config.
"""

from __future__ import annotations

from polyrl.distributed import launch
from polyrl.errors import ConfigError


def rollout_pool_size(cfg) -> int:
    """Processes of the off-policy pipeline's rollout pool (trainer/async_ppo.py); 0 while the engine is colocated."""
    actor_rollout_ref = getattr(cfg, "actor_rollout_ref", None)
    if actor_rollout_ref is None or getattr(actor_rollout_ref, "hybrid_engine", True):  # flow's config has no such key
        return 0
    return cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node


def launch_job(cfg) -> launch.Job:
    """The processes `cfg.trainer` (and the rollout pool) ask for. The off-policy pipeline runs on this host when it
    has a GPU for every process; otherwise across hosts through Ray, as verl places its two resource pools: the
    trainer's nodes first, then the rollout pool's, `n_gpus_per_node` processes each when both pools have the same
    (else one process per node). Job ranks are then trainer ranks first (trainer/rollout_pool.py)."""
    trainer = cfg.trainer
    if trainer.n_gpus_per_node < 1 or trainer.nnodes < 1:
        raise ConfigError(f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} and trainer.nnodes={trainer.nnodes} "
                          "must both be at least 1.")
    timeout = getattr(trainer, "ray_wait_register_center_timeout", launch.Job.placement_timeout_s)  # not in flow's
    pool = rollout_pool_size(cfg)
    processes = trainer.n_gpus_per_node * trainer.nnodes + pool
    if pool and (local_gpus(trainer.device) < processes or trainer.nnodes > 1 or cfg.rollout.nnodes > 1):
        per_node = trainer.n_gpus_per_node
        if per_node == cfg.rollout.n_gpus_per_node and local_gpus(trainer.device) >= per_node:
            return launch.Job(nproc_per_node=per_node, nnodes=trainer.nnodes + cfg.rollout.nnodes,
                              device=trainer.device, placement_timeout_s=timeout)
        return launch.Job(nproc_per_node=1, nnodes=processes, device=trainer.device, placement_timeout_s=timeout)
    return launch.Job(nproc_per_node=trainer.n_gpus_per_node, nnodes=trainer.nnodes, extra_processes=pool,
                      device=trainer.device, placement_timeout_s=timeout)


def local_gpus(device: str) -> int:
    """GPUs this host gives a job on `device` (cpu: as many processes as it likes)."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return 1 << 30
    return torch.cuda.device_count()


def processes_wanted(cfg) -> int:
    return launch_job(cfg).num_processes


def maybe_launch(cfg, argv: list[str], *, module: str = "polyrl.train") -> int | None:
    """Run `module argv` as the job `cfg` describes, if that is more than this one process (see
    `polyrl.distributed.launch.maybe_launch`): the job's exit status, or None to train in this process."""
    return launch.maybe_launch(launch_job(cfg), argv, module=module)


def check_data_parallel(cfg, world_size: int) -> None:
    """Batch arithmetic that sharding by prompt groups (`polyrl.distributed.data`) needs, beyond
    `trainer.checks.check_batch_sizes`."""
    if world_size == 1:
        return
    data, actor = cfg.data, cfg.actor_rollout_ref.actor
    if actor.ppo_mini_batch_size % world_size:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} prompts cannot be split over "
            f"{world_size} processes by whole prompt groups; make it a multiple of {world_size}.")
    if cfg.critic.enable and actor.ulysses_sequence_parallel_size > 1:
        raise ConfigError("A critic (algorithm.adv_estimator=gae) with actor_rollout_ref.actor."
                          "ulysses_sequence_parallel_size > 1 is not supported yet (the critic has no sequence "
                          "parallelism); set it to 1 or use a critic-free estimator such as grpo.")
    gen = data.gen_batch_size
    if gen not in (None, data.train_batch_size) and not cfg.algorithm.filter_groups.enable:
        raise ConfigError(f"data.gen_batch_size={gen} differs from train_batch_size with several processes, which "
                          "only DAPO dynamic sampling (algorithm.filter_groups.enable=True) draws; leave it unset.")
    if gen is not None and gen % actor.ppo_mini_batch_size:
        raise ConfigError(f"data.gen_batch_size={gen} prompts cannot be split over {world_size} processes like a "
                          f"batch; make it a multiple of actor_rollout_ref.actor.ppo_mini_batch_size="
                          f"{actor.ppo_mini_batch_size}.")
