"""Score rollout chunks in worker processes while the trainer generates the next chunk (VeRL-Omni's streamed reward).

The trainer calls `submit(offset, images, prompts, metadata)` as soon as a micro-batch of images is decoded and
`collect(batch)` once generation ends; only scoring that is still running then is waited for. The update stays
on-policy: the trainer still waits for the whole scored batch before computing advantages (as VeRL-Omni).

Workers are spawned processes that build their own reward fn from a picklable `factory(*args)`, so heavy engines
(rapidocr, a reward model on another GPU) load once per worker and never in the trainer process.
When it pays: only when scoring is a large share of the step and runs on resources generation doesn't use (another
GPU, an OCR engine on spare CPU cores). On a 2-core CPU both stages compete for the same cores.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_lib
from collections.abc import Callable

import torch

from polyrl.errors import RewardError


def _worker(factory, args, inbox, outbox):
    torch.set_num_threads(1)
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
            scores = torch.as_tensor(fn(images, prompts, metadata), dtype=torch.float32).reshape(-1)
            outbox.put((offset, scores))
        except Exception as e:
            outbox.put(("error", f"reward fn raised {type(e).__name__}: {e}"))


class AsyncRewardScorer:
    """A pool of reward worker processes fed chunk by chunk; `collect` reassembles scores in submission order."""

    def __init__(self, factory: Callable, args: tuple = (), num_workers: int = 1, timeout_s: float = 600.0):
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.timeout_s = timeout_s
        self.procs = [ctx.Process(target=_worker, args=(factory, args, self.inbox, self.outbox), daemon=True)
                      for _ in range(num_workers)]  # fmt: skip
        for p in self.procs:
            p.start()
        self.pending = 0

    def submit(self, offset: int, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> None:
        self.inbox.put((offset, images.detach().cpu(), list(prompts), list(metadata)))
        self.pending += 1

    def collect(self, batch: int) -> torch.Tensor:
        """Scores for offsets 0..batch-1 once every submitted chunk is scored."""
        parts = {}
        while self.pending:
            try:
                offset, scores = self.outbox.get(timeout=self.timeout_s)
            except queue_lib.Empty as e:
                raise RewardError(f"async reward workers returned nothing for {self.timeout_s:.0f}s; check the reward fn.") from e
            if offset == "error":
                self.pending = 0
                raise RewardError(f"async reward worker: {scores}; fix the reward function.")
            parts[offset] = scores
            self.pending -= 1
        out = torch.cat([parts[k] for k in sorted(parts)])
        if out.numel() != batch:
            raise RewardError(f"async reward returned {out.numel()} scores for {batch} images; return one per image.")
        return out

    def close(self) -> None:
        for _ in self.procs:
            self.inbox.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
