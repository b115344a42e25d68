"""The tensor batch one RL step works on, and how it is cut into mini- and micro-batches.

Layout (verl's): each row is `[left-padded prompt | right-padded response]` with `P` prompt and `T` response
columns. `logits[:, P-1+t]` predicts response token `t`. Rows are whole sequences; slicing rows never changes the
columns, so a row's log-prob is computed on identical shapes in every pass that uses the same micro-batch size.
"""

from __future__ import annotations

from typing import Iterator

import torch

Batch = dict[str, torch.Tensor]


def build_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], *, pad_token_id: int,
                device: torch.device) -> Batch:
    B = len(prompt_ids)
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(r) for r in response_ids))
    input_ids = torch.full((B, P + T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[b, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        attention_mask[b, P - len(p):P] = 1
        if r:
            input_ids[b, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[b, P:P + len(r)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": input_ids[:, P:].clone(),
        "response_mask": attention_mask[:, P:].float(),
        "prompt_lengths": torch.tensor([len(p) for p in prompt_ids]),
        "response_lengths": torch.tensor([len(r) for r in response_ids]),
    }
    return {k: v.to(device) for k, v in batch.items()}


def select(batch: Batch, rows: torch.Tensor | slice) -> Batch:
    return {k: v[rows] for k, v in batch.items()}


def split_rows(num_rows: int, size: int) -> Iterator[slice]:
    for start in range(0, num_rows, size):
        yield slice(start, min(start + size, num_rows))


def trim_columns(batch: Batch) -> Batch:
    """Drop all-padding columns at both ends (a micro-batch of short rows needs fewer columns)."""
    L = batch["input_ids"].shape[1]
    P = L - batch["responses"].shape[1]
    used = batch["attention_mask"].bool().any(0)
    col = torch.arange(L, device=used.device)
    # first used prompt column (P if none), one past the last used response column (P + 1 if none): one host read
    first, last = torch.stack([torch.where(used & (col < P), col, P).min(),
                               torch.where(used & (col >= P), col + 1, P + 1).max()]).tolist()
    out = dict(batch)
    for key in ("input_ids", "attention_mask", "position_ids", "routed_experts"):
        if key in batch:
            out[key] = batch[key][:, first:last]
    T = last - P
    for key, v in batch.items():
        if v.dim() == 2 and v.shape[1] == batch["responses"].shape[1] and key not in ("input_ids",):
            out[key] = v[:, :T]
    return out


def pad_columns(batch: Batch, prompt_width: int, response_width: int) -> Batch:
    """Widen a batch to `[prompt_width | response_width]` columns: prompts are left-padded, responses right-padded.

    Keys are classified by shape: `[B, P+T]` (input_ids, masks, positions), `[B, T]` (per-response-token values) and
    per-row `[B]`; padding is 0 (masked out everywhere it matters)."""
    T = batch["responses"].shape[1]
    P = batch["input_ids"].shape[1] - T
    assert prompt_width >= P and response_width >= T, (prompt_width, P, response_width, T)
    out = {}
    for key, v in batch.items():
        if key == "routed_experts":  # [B, P+T, layers, top_k]; -1: no recorded route
            out[key] = torch.cat([v.new_full((v.shape[0], prompt_width - P, *v.shape[2:]), -1), v,
                                  v.new_full((v.shape[0], response_width - T, *v.shape[2:]), -1)], dim=1)
        elif v.dim() >= 2 and v.shape[1] == P + T and key in ("input_ids", "attention_mask", "position_ids"):
            out[key] = torch.nn.functional.pad(v, (prompt_width - P, response_width - T))
        elif v.dim() >= 2 and v.shape[1] == T:
            out[key] = torch.nn.functional.pad(v, (0, response_width - T))
        else:
            out[key] = v
    return out


def concat_rows(batches: list[Batch]) -> Batch:
    """Rows of several batches in one (columns padded to the widest prompt and response)."""
    P = max(b["input_ids"].shape[1] - b["responses"].shape[1] for b in batches)
    T = max(b["responses"].shape[1] for b in batches)
    padded = [pad_columns(b, P, T) for b in batches]
    return {k: torch.cat([b[k] for b in padded]) for k in padded[0]}
