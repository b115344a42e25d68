"""The off-policy rollout process's scoring, one batch behind its generation (trainer/async_ppo.py).

Where the reward runs in a process of its own (a reward model on GPUs of its own, `enable_resource_pool`, or the
rule reward's Ray actor), the rollout process need not wait for it: batch k is handed to a thread that scores it,
assembles it and sends it to the trainer, while the main thread goes on to generate batch k+1 as soon as the age
limit lets it:

    rollout (main):    gen b0 | gen b1          | recv v1, gen b2 ...
    rollout (thread):         | score b0, send  | score b1, send ...
    reward worker:            | RM(b0)          | RM(b1) ...

With the default age of one step, batch k+1 needs the weights trained on batch k-1, which left one scoring earlier,
so generation waits for neither the scoring nor the step it feeds; with age 0 it waits for both (no overlap).

The thread queues no GPU work (it ships the scored rows; the trainer assembles the batch, the scorer is elsewhere)
and times without synchronizing, so it never waits behind the generation's kernels. Only the thread sends batches,
so they leave in order; their objects travel on the job-wide link's gloo group (`p2p.Link.objects`), apart from the
NCCL group of the weights the main thread receives meanwhile (on CPU both are the one gloo group; their tags differ).
One trainer and one rollout process only, for now (async_ppo.RolloutWorker refuses a pool with such a reward).

Metrics of each batch, besides the serial pipeline's: `timing_s/reward` is its scoring as the thread saw it (the
worker's `timing_s/reward_model` and `timing_s/reward_fn`, plus the round trip), and `timing_s/reward_overlap` the
seconds of it during which the main thread was generating the next batch: scoring the step did not wait for.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor

from polyrl.trainer.rollout_pool import row_versions
from polyrl.utils.timing import StepTimer


class ScoringFailed(Exception):
    """The thread failed a batch and has told the trainer; the main thread stops without a second message."""


def overlap_s(start: float, end: float, span: list[float] | None) -> float:
    """Seconds of [start, end] inside `span` ([begin, finish]; finish None: still running)."""
    if span is None:
        return 0.0
    begin, finish = span
    return max(0.0, min(end, end if finish is None else finish) - max(start, begin))


class ScoringBehind:
    """Scores each generated batch and sends it on one thread (module docstring). `deliver(k, parts, metrics,
    timings, position)` sends batch k's scored parts to the trainer; `fail(k, error)` tells it that batch k failed."""

    def __init__(self, roll, deliver, fail):
        self.roll, self.deliver, self.fail = roll, deliver, fail
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyrl-scoring")
        self.timer = StepTimer(sync=False)
        self.gen_spans: dict[int, list] = {}  # batch index -> [start, end] of its generation (end None: running)
        self.futures: list[Future] = []

    def generate(self, k: int, timer: StepTimer, version: int) -> None:
        """Generate batch k here and hand it to the thread; raises `ScoringFailed` once the thread has failed."""
        self.raise_failure()
        roll = self.roll
        self.gen_spans[k] = [time.perf_counter(), None]
        prompts, out = roll._generate_batch(timer)
        self.gen_spans[k][1] = time.perf_counter()
        # the position after batch k's prompts, before batch k+1 draws its own (a resume regenerates batch k+1)
        position = {"sampler": copy.deepcopy(roll.sampler.state_dict()), "engine": roll._engine_generator_state()}
        self.futures.append(self.pool.submit(self._finish, k, prompts, out, timer.pop(), version, position))

    def _finish(self, k, prompts, out, timings, version, position) -> None:
        try:
            metrics = dict(getattr(out, "metrics", {}))
            t0 = time.perf_counter()
            part = self.roll._scored_part(prompts, out, self.timer, metrics, step=k + 1)
            t1 = time.perf_counter()
            part["versions"] = row_versions(out, version)
            timings = {**timings, **self.timer.pop(),
                       "timing_s/reward_overlap": overlap_s(t0, t1, self.gen_spans.get(k + 1))}
            self.gen_spans.pop(k, None)
            self.deliver(k, [part], metrics, timings, position)
        except Exception as e:
            self.fail(k, f"{type(e).__name__}: {e}")
            raise ScoringFailed(f"scoring batch {k} failed: {type(e).__name__}: {e}") from e

    def raise_failure(self) -> None:
        for f in self.futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        self.futures = [f for f in self.futures if not f.done()]

    def close(self) -> None:
        """Wait for every handed batch to be sent; raises the thread's failure, if any."""
        self.pool.shutdown(wait=True)
        self.raise_failure()
