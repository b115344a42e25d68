"""Beyond one process: torchrun/FSDP2 data parallelism, sharded checkpoints, and Ray for multi-node and workers.

- `env.DistEnv`: the one object owning the process group, device and device mesh (gloo on CPU, nccl on GPU).
- `parallelize.parallelize(model, mesh, cfg, device)`: per-block FSDP2 from outside the model code.
- `data`: which prompt groups each rank generates for; merging per-rank step metrics (the batch checks that
  sharding needs read the trainer config, so they live in `polyrl.trainer.job`).
- `weights.full_tensors`: streamed weight sync from the sharded actor into each rank's rollout engine.
- `checkpoint`: DCP save/load, atomic, loadable at a different process count.
- `grads.clip_grad_norm_`: clipping across sharded and replicated parameters.
- `launch`: polyrl relaunching itself under torchrun, and on several nodes through Ray (from a plain `Job`, never a
  trainer config: `polyrl.trainer.job` builds it); `ray_cluster`: joining a Ray cluster. The Ray reward worker
  lives in `polyrl.rewards.remote`.
"""

from polyrl.distributed.env import DistEnv, launched_world_size

__all__ = ["DistEnv", "launched_world_size"]
