"""The reward function in its own process: a Ray actor on CPUs, or with GPUs of its own for a model-based scorer; or,
for a reward model on one host without Ray, a process spawned here.

- `RewardActor` / `RayReward`: the one Ray reward actor and its client, for both trainers: the actor builds the
  reward function from a factory in its own process; `submit` returns a future.
- `ProcessReward`: `RayReward`'s interface over one spawned process pinned to GPUs of this host
  (CUDA_VISIBLE_DEVICES set before it starts). `reward_worker` picks: Ray where a cluster is there to place the actor
  (RAY_ADDRESS set or Ray already started: several nodes, or GPUs Ray was told about), else this process. The Ray
  wheel is large and single-host GPU machines often lack it; a reward model on a spare GPU of the same host needs no
  scheduler.
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

import contextlib
import multiprocessing as mp
import os
import queue as queue_lib
import sys
import time
from collections.abc import Callable
from typing import Any

from polyrl.distributed.ray_cluster import import_ray, init_ray
from polyrl.errors import ConfigError, RewardError, UserError


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


def local_reward_gpus(n_gpus_per_node: int, key: str) -> list[str]:
    """This rank's reward GPUs on this host without Ray, as CUDA_VISIBLE_DEVICES entries: the node's reward pool is
    the `n_gpus_per_node` GPUs after the LOCAL_WORLD_SIZE ones the job's processes use (cuda:0.. by local rank), and
    each rank takes its share (ranks share one GPU when the pool has fewer). Empty: 0 GPUs asked, the CPU."""
    import torch

    if n_gpus_per_node < 0:
        raise ConfigError(f"{key}={n_gpus_per_node} must be >= 0 (0: the reward process runs on CPUs).")
    if n_gpus_per_node == 0:
        return []
    ranks, rank = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d for d in listed.split(",") if d.strip()] if listed is not None else \
        [str(i) for i in range(torch.cuda.device_count())]
    if len(visible) < ranks + n_gpus_per_node:
        raise ConfigError(f"{key}={n_gpus_per_node} asks for reward GPUs beside the {ranks} this host's training "
                          f"process(es) use, but {len(visible)} GPU(s) are visible; set it to at most "
                          f"{max(0, len(visible) - ranks)}, or turn enable_resource_pool off to colocate the model.")
    first = ranks + rank * n_gpus_per_node // ranks
    return visible[first:first + max(1, n_gpus_per_node // ranks)]


def _serve(factory: Callable, args: tuple, inbox, outbox) -> None:
    """`ProcessReward`'s process: build `factory(*args)`, then answer (ticket, call args) with (ticket, ok, value)."""
    try:
        fn = factory(*args)
    except Exception as e:  # say why instead of leaving the trainer waiting
        outbox.put((None, False, (isinstance(e, UserError), f"building the reward raised {type(e).__name__}: {e}")))
        return
    while (item := inbox.get()) is not None:
        ticket, call = item
        try:
            outbox.put((ticket, True, fn(*call)))
        except Exception as e:
            outbox.put((ticket, False, (isinstance(e, UserError), f"{type(e).__name__}: {e}")))


@contextlib.contextmanager
def _environ(**env: str):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ProcessReward:
    """`RayReward`'s interface over one process spawned on this host that sees only `gpus` (CUDA_VISIBLE_DEVICES
    entries; empty: none, it computes on CPUs): it builds `factory(*args)` once and serves `submit`ted calls in order.
    Queues, not a pipe: a queue's feeder thread sends, so a large request never blocks against a large answer."""

    def __init__(self, factory: Callable, args: tuple = (), *, gpus: list[str], timeout_s: float = 3600.0):
        ctx = mp.get_context("spawn")  # a fork would inherit this process's CUDA context
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.gpus, self.timeout_s = gpus, timeout_s
        with _environ(CUDA_VISIBLE_DEVICES=",".join(gpus)):  # a spawned child starts with this environment
            self.proc = ctx.Process(target=_serve, args=(factory, args, self.inbox, self.outbox), daemon=True)
            self.proc.start()
        self.next_ticket, self.answers = 0, {}

    def submit(self, *args) -> int:
        ticket, self.next_ticket = self.next_ticket, self.next_ticket + 1
        self.inbox.put((ticket, args))
        return ticket

    def get(self, tickets, timeout: float | None = None):
        """The answer to a ticket (a list of them: their answers); the reward's exception as one sentence."""
        want = tickets if isinstance(tickets, list) else [tickets]
        deadline = time.monotonic() + (timeout or self.timeout_s)
        while any(t not in self.answers for t in want):
            try:
                ticket, ok, value = self.outbox.get(timeout=1.0)
            except queue_lib.Empty:
                if not self.proc.is_alive():
                    raise RewardError(f"The reward process (pid {self.proc.pid}) died with exit code "
                                      f"{self.proc.exitcode}; see its output above.") from None
                if time.monotonic() > deadline:
                    raise RewardError(f"The reward process answered nothing for {timeout or self.timeout_s:.0f}s; "
                                      "check the reward model and function.") from None
                continue
            if not ok:
                user, message = value
                raise (ConfigError if user else RewardError)(message if user else f"The reward process: {message}")
            self.answers[ticket] = value
        got = [self.answers.pop(t) for t in want]
        return got if isinstance(tickets, list) else got[0]

    def close(self) -> None:
        self.inbox.put(None)
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.terminate()


def reward_worker(factory: Callable, args: tuple, *, n_gpus_per_node: int, key: str, address: str | None = None):
    """The reward in a process of its own with this rank's share of the node's `n_gpus_per_node` reward GPUs: a Ray
    actor when a Ray cluster is there to place it, else a process spawned on this host (module docstring)."""
    ray = sys.modules.get("ray")
    if address or os.environ.get("RAY_ADDRESS") or (ray is not None and ray.is_initialized()):
        return RayReward(factory, args, num_gpus=reward_gpus_per_rank(n_gpus_per_node, key), key=key, address=address)
    return ProcessReward(factory, args, gpus=local_reward_gpus(n_gpus_per_node, key))


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
