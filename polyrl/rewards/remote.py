"""The reward function in its own process: a Ray actor on CPUs, or with GPUs of its own for a model-based scorer.

- `RewardActor` / `RayReward`: the one Ray reward actor and its client, for both trainers: the actor builds the
  reward function from a factory in its own process; `submit` returns a future.
- `RemoteReward`: `RayReward` with `RewardManager.score`'s signature, so the LLM trainer cannot tell the difference.
  It is what `reward_model.launch_reward_fn_async=True` selects; `score_async` returns a future for overlapping the
  scoring with other work. FlowGRPO's `async_scorer.RayRewardScorer` is the same actor behind its chunked
  `submit`/`collect` interface.
- `reward_cluster`: with `reward_model.enable_resource_pool` the actor holds GPUs of its own; this refuses that
  without a cluster started with only those GPUs visible (a local Ray would hand out the trainer's).
- `reward_gpus_per_rank`: a node's reward GPUs shared by its ranks. FlowGRPO's `async_scorer.RayRewardScorer` uses
  the same two helpers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from polyrl.distributed.ray_cluster import import_ray, init_ray
from polyrl.errors import ConfigError


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
    if num_gpus > 0 and not import_ray().is_initialized() and not (address or os.environ.get("RAY_ADDRESS")):
        raise ConfigError(f"{key} gives the reward actor GPUs of its own, which needs a Ray cluster that knows them: "
                          f"{start}and set RAY_ADDRESS=auto, or set it to 0.")
    ray = init_ray(address)
    have = ray.cluster_resources().get("GPU", 0)
    if num_gpus > have:
        raise ConfigError(f"{key} asks the Ray reward actor for {num_gpus:g} GPU(s) but the Ray cluster has {have:g}; "
                          f"{start}or set it to 0.")
    return ray


class RewardActor:
    """The one Ray reward actor both trainers use: builds `factory(*args)` once in its own process (a reward model
    loads there, on the actor's GPUs, never in the trainer) and calls it for each `score`."""

    def __init__(self, factory: Callable, args: tuple):
        self.fn = factory(*args)

    def score(self, *args):
        return self.fn(*args)

    def pid(self) -> int:
        return os.getpid()


class RayReward:
    """Client of one `RewardActor` with `num_gpus` GPUs of its own (`key` names that setting in errors): `submit`
    returns a future right away, `get` waits for futures."""

    def __init__(self, factory: Callable, args: tuple = (), *, num_gpus: float = 0.0, num_cpus: float = 1.0,
                 key: str, address: str | None = None):  # fmt: skip
        self.ray = reward_cluster(num_gpus, key, address)
        self.actor = self.ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(RewardActor).remote(factory, args)

    def submit(self, *args):
        return self.actor.score.remote(*args)

    def get(self, refs, timeout: float | None = None):
        return self.ray.get(refs, timeout=timeout)

    def close(self) -> None:
        self.ray.kill(self.actor)


def manager_score(custom_reward_function, overlong_buffer, max_response_length: int) -> Callable:
    """The LLM trainer's configured `RewardManager.score`, built where it is called (a `RewardActor` factory)."""
    from polyrl.rewards import RewardManager, build_reward_fn

    return RewardManager(build_reward_fn(custom_reward_function), overlong_buffer=overlong_buffer,
                         max_response_length=max_response_length).score


class RemoteReward(RayReward):
    """`RewardManager`'s interface over a `RewardActor` (`reward_model.launch_reward_fn_async`)."""

    def __init__(self, custom_reward_function, overlong_buffer, max_response_length: int, *, num_cpus: float = 1,
                 num_gpus: float = 0, address: str | None = None):
        super().__init__(manager_score, (custom_reward_function, overlong_buffer, max_response_length),
                         num_gpus=num_gpus, num_cpus=num_cpus, key="reward_model.n_gpus_per_node", address=address)

    def score_async(self, samples, response_lengths=None):
        """A Ray ObjectRef; pass it to `result` when the scores are needed."""
        return self.submit(samples, response_lengths)

    def result(self, ref):
        return self.get(ref)

    def score(self, samples, response_lengths=None):
        return self.result(self.score_async(samples, response_lengths))
