"""Score rollout chunks in worker processes while the trainer generates the next chunk (VeRL-Omni's streamed reward).

The trainer calls `submit(offset, images, prompts, metadata)` as soon as a micro-batch of images is decoded and
`collect(batch)` once generation ends; only scoring that is still running then is waited for. The update stays
on-policy: the trainer still waits for the whole scored batch before computing advantages (as VeRL-Omni).

Workers are spawned processes that build their own reward fn from a picklable `factory(*args)`, so heavy engines
(rapidocr, a reward model on another GPU) load once per worker and never in the trainer process.
When it pays: only when scoring is a large share of the step and runs on resources generation doesn't use (another
GPU, an OCR engine on spare CPU cores). On a 2-core CPU both stages compete for the same cores.

`RayRewardScorer` is the same interface over a Ray actor that holds GPUs of its own (VeRL-Omni's reward resource
pool: `reward.reward_model.enable_resource_pool=True`): Ray sets the actor's CUDA_VISIBLE_DEVICES, so a reward model
built with `device="cuda"` lands on the reward GPU, never on a trainer's.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_lib
from collections.abc import Callable

import torch

from polyrl.errors import RewardError
from polyrl.utils.device import cpu_share

REWARD_THREADS = "POLYRL_REWARD_THREADS"


def _portable(images: torch.Tensor):
    """Images as a numpy array for the trip to the worker. Sending a torch tensor through a multiprocessing queue
    uses torch's shared-memory reducer, after which this process's torch compute ran 40-70% slower (measured on
    CPU, also after the queue was closed); numpy arrays pickle as plain bytes."""
    return images.detach().float().cpu().numpy()


def _score(fn, images, prompts, metadata) -> torch.Tensor:
    return torch.as_tensor(fn(torch.from_numpy(images), prompts, metadata), dtype=torch.float32).reshape(-1)


def _worker(factory, args, inbox, outbox, threads: int):
    import os

    torch.set_num_threads(1)
    os.environ[REWARD_THREADS] = str(threads)  # the engine's thread budget (image_rewards.OCRReward reads it)
    try:
        fn = factory(*args)
    except Exception as e:  # report the failure instead of hanging the trainer
        outbox.put(("error", f"building the reward fn raised {type(e).__name__}: {e}"))
        return
    while True:
        item = inbox.get()
        if item is None:
            return
        offset, images, prompts, metadata = item
        try:
            outbox.put((offset, _score(fn, images, prompts, metadata).numpy()))  # numpy both ways: see _portable
        except Exception as e:
            outbox.put(("error", f"reward fn raised {type(e).__name__}: {e}"))


class AsyncRewardScorer:
    """A pool of reward worker processes fed chunk by chunk; `collect` reassembles scores in submission order."""

    def __init__(self, factory: Callable, args: tuple = (), num_workers: int = 1, timeout_s: float = 600.0):
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.timeout_s = timeout_s
        # each worker's engine gets its share of the cores: rapidocr's onnxruntime otherwise starts a thread per core
        # in every worker of every rank, and on 4 H200s (64 cores, 4 ranks x 8 workers) OCR then slowed generation
        threads = cpu_share(num_workers)
        self.procs = [ctx.Process(target=_worker, args=(factory, args, self.inbox, self.outbox, threads), daemon=True)
                      for _ in range(num_workers)]  # fmt: skip
        for p in self.procs:
            p.start()
        self.pending = 0

    def submit(self, offset: int, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> None:
        """Queue a chunk, split in one piece per worker so they score it together (the last chunk of a rollout has
        no generation left to hide behind)."""
        size = -(-len(prompts) // len(self.procs))
        for lo in range(0, len(prompts), size):
            self.inbox.put((offset + lo, _portable(images[lo : lo + size]), list(prompts[lo : lo + size]),
                            list(metadata[lo : lo + size])))  # fmt: skip
            self.pending += 1

    def collect(self, batch: int) -> torch.Tensor:
        """Scores for offsets 0..batch-1 once every submitted chunk is scored."""
        parts: dict[int, torch.Tensor] = {}
        while self.pending:
            try:
                offset, scores = self.outbox.get(timeout=self.timeout_s)
            except queue_lib.Empty as e:
                raise RewardError(f"async reward workers returned nothing for {self.timeout_s:.0f}s; check the reward fn.") from e
            if offset == "error":
                self.pending = 0
                raise RewardError(f"async reward worker: {scores}; fix the reward function.")
            parts[offset] = torch.from_numpy(scores)
            self.pending -= 1
        return _in_order(parts, batch)

    def close(self) -> None:
        for _ in self.procs:
            self.inbox.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()


def _in_order(parts: dict[int, torch.Tensor], batch: int) -> torch.Tensor:
    out = torch.cat([parts[k] for k in sorted(parts)])
    if out.numel() != batch:
        raise RewardError(f"async reward returned {out.numel()} scores for {batch} images; return one per image.")
    return out


def tensor_reward(factory: Callable, args: tuple) -> Callable:
    """A `RewardActor` factory: the image reward fn `factory(*args)`, fed and answering numpy (see `_portable`)."""
    fn = factory(*args)
    return lambda images, prompts, metadata: _score(fn, images, prompts, metadata).numpy()


class RayRewardScorer:
    """`AsyncRewardScorer`'s interface over the Ray reward actor both trainers use (`polyrl.rewards.remote`), with
    `num_gpus` GPUs (fractions share a GPU: each trainer rank's actor asks for n_gpus_per_node / ranks per node, so
    the ranks of a node share the node's reward GPUs)."""

    def __init__(self, factory: Callable, args: tuple = (), num_gpus: float = 1.0, num_cpus: float = 1.0,
                 timeout_s: float = 600.0, address: str | None = None):  # fmt: skip
        from polyrl.rewards.remote import RayReward

        self.remote = RayReward(tensor_reward, (factory, args), num_gpus=num_gpus, num_cpus=num_cpus,
                                key="reward.reward_model.n_gpus_per_node", address=address)  # fmt: skip
        self.timeout_s = timeout_s
        self.refs: dict[int, object] = {}

    def submit(self, offset: int, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> None:
        self.refs[offset] = self.remote.submit(_portable(images), list(prompts), list(metadata))

    def collect(self, batch: int) -> torch.Tensor:
        refs, self.refs = self.refs, {}
        try:
            got = self.remote.get(list(refs.values()), timeout=self.timeout_s)
        except self.remote.ray.exceptions.GetTimeoutError as e:
            raise RewardError(f"the Ray reward worker returned nothing for {self.timeout_s:.0f}s; "
                              "check the reward fn.") from e
        except self.remote.ray.exceptions.RayError as e:  # the fn (or building it) raised inside the actor
            raise RewardError(f"Ray reward worker: {str(e).strip().splitlines()[-1]}; fix the reward function.") from e
        return _in_order({k: torch.from_numpy(v) for k, v in zip(refs, got)}, batch)

    def close(self) -> None:
        self.remote.close()


def build_scorer(reward_cfg, factory: Callable, args: tuple = ()):
    """The scorer `reward_cfg` (FlowConfig.reward) asks for: a Ray actor on the reward resource pool, a process pool
    (`async_reward`), or None (scored in the trainer). `factory(*args)` builds the reward fn in the worker."""
    pool = reward_cfg.reward_model
    if pool.enable_resource_pool:
        from polyrl.rewards.remote import reward_gpus_per_rank

        gpus = reward_gpus_per_rank(pool.n_gpus_per_node, "reward.reward_model.n_gpus_per_node")
        return RayRewardScorer(factory, args, num_gpus=gpus)
    if reward_cfg.async_reward:
        return AsyncRewardScorer(factory, args, reward_cfg.num_workers)
    return None
