"""Ray, for what torchrun cannot do alone: placing one process group per node, and workers apart from the trainer.

- `init_ray(address)`: join a running cluster (`address`, or `RAY_ADDRESS`, e.g. set by `ray start --head` on the
  node) or start a local one.
- `launch_on_ray(cfg, argv)`: `trainer.nnodes > 1`. One placement-group bundle per node (`STRICT_SPREAD`, each with
  `trainer.n_gpus_per_node` GPUs), one Ray task per bundle that runs a torchrun agent for that node
  (`--nnodes/--node_rank/--master_addr` pointing at bundle 0's node). The training processes are ordinary torchrun
  children, so the whole trainer, FSDP2 and NCCL code is identical on one node and on many; Ray only places them.
- `RewardWorker` / `RemoteReward`: the reward function in its own process (a Ray actor on CPUs, or a GPU for a
  model-based scorer), with `RewardManager.score`'s signature so the trainer cannot tell the difference. It is what
  `reward_model.launch_reward_fn_async=True` selects; `score_async` returns a future for overlapping the scoring
  with other work. With `reward_model.enable_resource_pool` the actor holds GPUs of its own; `reward_cluster`
  refuses that without a cluster started with only those GPUs visible (a local Ray would hand out the trainer's).

Ray is an optional extra (`pip install 'polyrl[ray]'`): nothing here is imported on a single-node run.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from polyrl.errors import ConfigError


def _ray():
    try:
        import ray
    except ImportError as e:
        raise ConfigError("This setting needs Ray (multi-node placement or reward_model.launch_reward_fn_async); "
                          "`pip install 'polyrl[ray]'` or turn it off.") from e
    return ray


def init_ray(address: str | None = None, **kwargs) -> Any:
    """Join the cluster at `address` / $RAY_ADDRESS, or start a local one; idempotent."""
    ray = _ray()
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or None
        ray.init(address=address, include_dashboard=False, log_to_driver=False, **kwargs)
    return ray


def reward_gpus_per_rank(n_gpus_per_node: int, key: str) -> float:
    """This rank's share of its node's reward GPUs: the node's ranks each ask Ray for a fraction of them."""
    if n_gpus_per_node < 0:
        raise ConfigError(f"{key}={n_gpus_per_node} must be >= 0 (0: the Ray reward actor runs on CPUs).")
    return n_gpus_per_node / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def reward_cluster(num_gpus: float, key: str, address: str | None = None) -> Any:
    """The Ray cluster for a reward actor that asks for `num_gpus` GPUs (`key` names the setting in errors).

    Refused with one sentence, instead of a silent GPU clash or a placement that never comes: GPUs without a cluster
    to join (a local Ray started here would hand out the trainer's own GPUs: torchrun's ranks are not Ray workers),
    and more GPUs than the cluster has."""
    start = "start Ray with only the reward GPUs visible (CUDA_VISIBLE_DEVICES=<gpu> ray start --head --num-gpus=1) "
    if num_gpus > 0 and not _ray().is_initialized() and not (address or os.environ.get("RAY_ADDRESS")):
        raise ConfigError(f"{key} gives the reward actor GPUs of its own, which needs a Ray cluster that knows them: "
                          f"{start}and set RAY_ADDRESS=auto, or set it to 0.")
    ray = init_ray(address)
    have = ray.cluster_resources().get("GPU", 0)
    if num_gpus > have:
        raise ConfigError(f"{key} asks the Ray reward actor for {num_gpus:g} GPU(s) but the Ray cluster has {have:g}; "
                          f"{start}or set it to 0.")
    return ray


# ------------------------------------------------------------------------------------------------ reward worker
class RewardWorker:
    """Builds the configured `RewardManager` inside the worker process and scores batches there."""

    def __init__(self, custom_reward_function, overlong_buffer, max_response_length: int):
        from polyrl.rewards import RewardManager, build_reward_fn

        self.manager = RewardManager(build_reward_fn(custom_reward_function), overlong_buffer=overlong_buffer,
                                     max_response_length=max_response_length)

    def score(self, samples, response_lengths=None):
        return self.manager.score(samples, response_lengths=response_lengths)

    def pid(self) -> int:
        return os.getpid()


class RemoteReward:
    """Client of one `RewardWorker` actor with `RewardManager`'s interface."""

    def __init__(self, custom_reward_function, overlong_buffer, max_response_length: int, *, num_cpus: float = 1,
                 num_gpus: float = 0, address: str | None = None):
        ray = reward_cluster(num_gpus, "reward_model.n_gpus_per_node", address)
        self._ray = ray
        self.actor = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(RewardWorker).remote(
            custom_reward_function, overlong_buffer, max_response_length)

    def score_async(self, samples, response_lengths=None):
        """A Ray ObjectRef; `ray.get` it (or pass it to `result`) when the scores are needed."""
        return self.actor.score.remote(samples, response_lengths)

    def result(self, ref):
        return self._ray.get(ref)

    def score(self, samples, response_lengths=None):
        return self.result(self.score_async(samples, response_lengths))

    def close(self) -> None:
        self._ray.kill(self.actor)


# ------------------------------------------------------------------------------------------------ multi-node launch
def _node_address() -> tuple[str, int]:
    """This node's IP and a free TCP port (run on bundle 0's node: the torch rendezvous master)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    import ray

    return ray.util.get_node_ip_address(), port


def _run_agent(cmd: list[str], env: dict[str, str], cwd: str) -> int:
    import subprocess

    return subprocess.call(cmd, env={**os.environ, **env}, cwd=cwd)


def launch_on_ray(cfg, argv: list[str], *, module: str = "polyrl.train", strategy: str = "STRICT_SPREAD",
                  address: str | None = None) -> int:
    """Run `module argv` as `nnodes` torchrun agents, one per Ray node; returns the worst exit status.

    `strategy="SPREAD"` lets the bundles share a node (used to test the recipe on one machine)."""
    from polyrl.distributed.launch import torchrun_command

    ray = init_ray(address)
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    t = cfg.trainer
    use_gpu = t.device != "cpu" and (t.device == "cuda" or bool(ray.cluster_resources().get("GPU")))
    bundle = {"CPU": 1, **({"GPU": t.n_gpus_per_node} if use_gpu else {})}
    pg = placement_group([dict(bundle) for _ in range(t.nnodes)], strategy=strategy)
    if not ray.get(pg.ready(), timeout=t.ray_wait_register_center_timeout):
        raise ConfigError(f"Ray could not place {t.nnodes} nodes x {bundle} within "
                          f"trainer.ray_wait_register_center_timeout={t.ray_wait_register_center_timeout}s; start "
                          "`ray start --address=<head>:6379` on every node first.")
    on = [PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
          for i in range(t.nnodes)]
    master_addr, master_port = ray.get(ray.remote(num_cpus=0)(_node_address).options(
        scheduling_strategy=on[0]).remote())
    agent = ray.remote(num_cpus=1, num_gpus=bundle.get("GPU", 0))(_run_agent)
    runs = []
    for node_rank in range(t.nnodes):
        cmd = torchrun_command(t.n_gpus_per_node, ["-m", module, *argv], nnodes=t.nnodes, node_rank=node_rank,
                               master_addr=master_addr, master_port=master_port)
        # Ray narrows CUDA_VISIBLE_DEVICES to the bundle's GPUs; torchrun then maps local ranks onto them
        # RAY_ADDRESS: the trainer's reward actors join this cluster instead of starting one per rank
        env = {"RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        runs.append(agent.options(scheduling_strategy=on[node_rank]).remote(cmd, env, os.getcwd()))
    codes = ray.get(runs)
    ray.util.remove_placement_group(pg)
    return max(codes, key=abs)
