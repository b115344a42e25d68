"""Data parallelism over whole GRPO groups: which prompts a rank generates for, and how step metrics are merged.

Every rank builds the same `PromptSampler` (same seed), draws the same global batch of prompts and keeps its share,
so no data moves between ranks. A prompt's `n` samples stay on one rank, hence group-relative advantages (GRPO,
RLOO, ...) need no communication.

The share is chosen so that *mini-batches* match the single-process run: global mini-batch `k` holds prompts
`[k*M, (k+1)*M)`; rank `r` takes the `r`-th slice of each of them. With `shuffle=False` the union over ranks of
rank-local mini-batch `k` is then exactly the single-process mini-batch `k`, and since loss normalisers are
all-reduced (see `Actor.update`), the update is the same up to float summation order.
"""

from __future__ import annotations


def shard_prompts(num_prompts: int, prompts_per_mini: int, rank: int, world_size: int) -> list[int]:
    """Indices of the prompts rank `rank` owns: its slice of every mini-batch (see module docstring)."""
    assert num_prompts % prompts_per_mini == 0 and prompts_per_mini % world_size == 0, \
        (num_prompts, prompts_per_mini, world_size)
    per_rank = prompts_per_mini // world_size
    return [start + rank * per_rank + i for start in range(0, num_prompts, prompts_per_mini) for i in range(per_rank)]


def shard_evenly(num_items: int, rank: int, world_size: int) -> range:
    """A contiguous slice for work with no mini-batch structure (validation prompts); sizes differ by at most one."""
    base, extra = divmod(num_items, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def padded_share(num_items: int, rank: int, world_size: int) -> tuple[list[int], int]:
    """`shard_evenly`'s slice padded (repeating its last item) to the same length on every rank, for work whose
    passes are collectives (an FSDP-sharded model's forwards); returns (indices, how many leading ones are real)."""
    share = list(shard_evenly(num_items, rank, world_size))
    longest = -(-num_items // world_size)
    return share + [share[-1] if share else 0] * (longest - len(share)), len(share)


def merge_step_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from every rank -> the job's: extremes of `/max` and `/min`, the slowest rank's timings,
    and the mean of everything else (ranks hold equal numbers of sequences, so the mean of per-rank sequence means is
    the global mean; token-weighted means are averaged with equal rank weights). Counts that must be job totals
    (perf/total_num_tokens) are all-reduced by the trainer before this, so they arrive equal on every rank."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    out: dict[str, float] = {}
    for key in per_rank[0]:
        vals = [m[key] for m in per_rank if key in m]
        if key.endswith("/max") or key.startswith(("timing_s/", "perf/max_memory")) or key == "perf/time_per_step":
            out[key] = max(vals)
        elif key.endswith("/min"):
            out[key] = min(vals)
        else:
            out[key] = sum(vals) / len(vals)
    return out


def gather_validation(env, sources: list, uids: list, infos: dict[str, list]):
    """Concatenate every rank's validation rows (rank order) so each rank computes the same @N statistics."""
    parts = env.all_gather_object((sources, uids, infos))
    all_sources = [x for p in parts for x in p[0]]
    all_uids = [x for p in parts for x in p[1]]
    all_infos = {k: [x for p in parts for x in p[2][k]] for k in parts[0][2]}
    return all_sources, all_uids, all_infos
