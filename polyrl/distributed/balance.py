"""`trainer.balance_batch`: equalise the tokens each data-parallel rank trains on, one mini-batch at a time.

Every rank generates for its own prompt groups, so with long-tailed response lengths one rank can hold far more
tokens than another, and FSDP's collectives make every rank wait for it. After advantages are computed (groups are
complete on their rank, so nothing about the math changes), the rows of each mini-batch are re-dealt across ranks:
the same number of rows per rank, token sums balanced (`equal_size_partition`). A mini-batch's rows stay in that
mini-batch, so the union over ranks of mini-batch k is still the 1-process mini-batch k and the update is unchanged
(losses are normalised by global counts, see training/actor.py). The rows travel as one all-gather of the CPU batch:
a few MB per rank at GRPO sizes, small next to a step.
"""

from __future__ import annotations

import torch

from polyrl.training.batch import Batch, concat_rows, select
from polyrl.training.dynamic_batch import equal_size_partition


def balance_across_ranks(batch: Batch, rows_per_mini: int, env) -> tuple[Batch, dict[str, float]]:
    """This rank's rows after balancing each mini-batch of `rows_per_mini` rows per rank across `env`'s ranks."""
    device = batch["responses"].device
    shards = env.all_gather_object({k: v.cpu() for k, v in batch.items()})
    W, B = env.world_size, batch["responses"].shape[0]
    assert all(s["responses"].shape[0] == B for s in shards), "ranks hold different row counts"
    mine, before, after = [], [], []
    for start in range(0, B, rows_per_mini):
        rows = slice(start, min(start + rows_per_mini, B))
        parts = [select(s, rows) for s in shards]
        merged = concat_rows(parts)
        lengths = merged["attention_mask"].sum(1).tolist()
        groups = equal_size_partition(lengths, W)
        mine.append(select(merged, torch.tensor(groups[env.rank])))
        before.append([int(p["attention_mask"].sum()) for p in parts])
        after.append([sum(lengths[i] for i in g) for g in groups])
    out = concat_rows(mine)
    metrics = {"perf/balance/max_over_mean_before": _imbalance(before),
               "perf/balance/max_over_mean_after": _imbalance(after)}
    return {k: v.to(device) for k, v in out.items()}, metrics


def _imbalance(loads_per_mini: list[list[int]]) -> float:
    """Tokens on the busiest rank over the mean, averaged over mini-batches (1.0 = perfectly balanced)."""
    ratios = [max(loads) / max(1e-9, sum(loads) / len(loads)) for loads in loads_per_mini]
    return sum(ratios) / len(ratios)
