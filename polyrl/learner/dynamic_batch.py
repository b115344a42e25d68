"""Dynamic batch size: micro-batches cut by a token budget and balanced, instead of a fixed number of rows.

With packing, a micro-batch costs its real token count, so `ppo_max_token_len_per_gpu` bounds memory directly and the
row count varies. We use the fewest micro-batches that fit the budget and balance their token sums with the LPT
greedy rule (longest sequence first, into the lightest micro-batch), like verl's `seqlen_balancing` (which uses
Karmarkar-Karp; LPT is within 4/3 of optimal and far simpler). If the greedy split overflows the budget we add one
micro-batch and retry. Which rows share a micro-batch does not change the loss: normalisers are fixed per
mini-batch (see actor.py).
"""

from __future__ import annotations

import heapq
import math


def balanced_micro_batches(lengths: list[int], max_tokens: int, min_groups: int = 1) -> list[list[int]]:
    """Partition row indices into the fewest balanced groups (at least `min_groups`) whose token sums are each
    <= `max_tokens`. With `min_groups` above the row count some groups are empty: data-parallel ranks must run the
    same number of micro-batches (FSDP's collectives), so a rank with fewer rows runs empty (padding) ones."""
    if not lengths:
        return [[] for _ in range(min_groups)] if min_groups > 1 else []
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(f"A sequence of {longest} tokens exceeds the micro-batch token budget {max_tokens}; raise "
                         "ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu to at least the longest "
                         "prompt+response (verl's rule of thumb: 2x (max_prompt_length + max_response_length)).")
    k = max(1, min_groups, math.ceil(sum(lengths) / max_tokens))
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    while True:
        heap = [(0, j) for j in range(k)]
        groups: list[list[int]] = [[] for _ in range(k)]
        for i in order:
            load, j = heapq.heappop(heap)
            groups[j].append(i)
            heapq.heappush(heap, (load + lengths[i], j))
        if max(load for load, _ in heap) <= max_tokens:
            return [sorted(g) for g in groups if g or min_groups > 1]
        k += 1


def shared_prompt_items(group_of_row: list[int], prompt_lens: list[int], resp_lens: list[int],
                        max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Rows that share a prompt as one item whose cost counts the prompt once (packing.py carries one copy per
    micro-batch), split into chunks that fit `max_tokens` (each chunk pays for its own copy). Returns (rows of each
    item, its token cost), to be balanced by `balanced_micro_batches(costs, ...)`."""
    by_group: dict[int, list[int]] = {}
    for row, g in enumerate(group_of_row):
        by_group.setdefault(g, []).append(row)
    items, costs = [], []
    for rows in by_group.values():
        prompt = prompt_lens[rows[0]]
        chunk, cost = [], prompt
        for r in sorted(rows, key=lambda r: (-resp_lens[r], r)):
            if chunk and cost + resp_lens[r] > max_tokens:
                items.append(sorted(chunk)), costs.append(cost)
                chunk, cost = [], prompt
            chunk.append(r)
            cost += resp_lens[r]
        items.append(sorted(chunk)), costs.append(cost)
    return items, costs


def fixed_micro_batches(num_rows: int, size: int) -> list[list[int]]:
    """Consecutive groups of `size` rows (the `*_micro_batch_size_per_gpu` path)."""
    return [list(range(s, min(s + size, num_rows))) for s in range(0, num_rows, size)]


def equal_size_partition(lengths: list[int], num_parts: int) -> list[list[int]]:
    """`num_parts` groups of exactly `len(lengths) / num_parts` rows with balanced token sums (LPT with a row cap).

    verl's `balance_batch` (get_seqlen_balanced_partitions with equal_size=True): data-parallel ranks must hold the
    same number of rows (mini-batch bookkeeping), and the step waits for the rank with the most tokens.
    """
    if len(lengths) % num_parts:
        raise ValueError(f"{len(lengths)} rows cannot be split into {num_parts} equal parts.")
    cap = len(lengths) // num_parts
    loads, groups = [0] * num_parts, [[] for _ in range(num_parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = min((j for j in range(num_parts) if len(groups[j]) < cap), key=lambda j: (loads[j], j))
        groups[j].append(i)
        loads[j] += lengths[i]
    return [sorted(g) for g in groups]
