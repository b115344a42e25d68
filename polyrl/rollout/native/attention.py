"""Attention over the paged KV cache, two ways.

- `decode` on CUDA: a Triton paged-decode kernel (`paged_decode.py`) reads each sequence's K/V blocks straight from
  the cache through a block table. One program per (sequence, kv head, split); the q heads of a GQA group share one
  K/V read. Static shapes, so the decode step captures into a CUDA graph.
- everything else (prefill chunks on any device, decode on CPU): gather each sequence's context from the cache into
  a padded [S, K] batch and call `scaled_dot_product_attention`. Prefill is a small share of rollout time, and this
  path is simple enough to be the CPU reference.

The cache layout is [num_blocks, block_size, kv_heads, head_dim] per layer; a token's "slot" is
block_id * block_size + offset, so writing new K/V is one `index_copy_` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnMeta:
    """Per-forward metadata; tensors live on the model's device. T = tokens in this forward, S = sequences."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token's K/V
    decode: bool = False  # True: one new token per sequence (T == S) and the paged kernel may be used
    # paged kernel inputs (decode on CUDA)
    seq_slots: torch.Tensor | None = None  # [S] int: row of each sequence in `block_tables`
    block_tables: torch.Tensor | None = None  # [num_rows, max_blocks] int32, rows indexed by seq_slots
    context_lens: torch.Tensor | None = None  # [S] int32: tokens in context, the new one included
    num_splits: int = 1  # split-K factor of the decode kernel (static per captured batch size)
    use_kernel: bool = False
    # gather path inputs
    gather_slots: torch.Tensor | None = None  # [S, K] int64 cache slots of each sequence's context (padded)
    q_index: torch.Tensor | None = None  # [S, Q] index into the flat T queries, T (a zero row) for padding
    out_index: torch.Tensor | None = None  # [T] index of each flat query in the padded S*Q layout
    mask: torch.Tensor | None = None  # [S, 1, Q, K] bool (True = attend); None = plain causal, no cached prefix


def write_kv(k_cache, v_cache, k_THD, v_THD, slot_mapping_T) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping_T, k_THD)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping_T, v_THD)


def paged_attention(q_THD, k_cache, v_cache, meta: AttnMeta, scale: float) -> torch.Tensor:
    if meta.use_kernel:
        from polyrl.rollout.native.paged_decode import paged_decode

        return paged_decode(q_THD, k_cache, v_cache, meta, scale)
    return gather_attention(q_THD, k_cache, v_cache, meta, scale)


def gather_attention(q_THD, k_cache, v_cache, meta: AttnMeta, scale: float) -> torch.Tensor:
    T, H, D = q_THD.shape
    kvh = k_cache.shape[2]
    S, Q = meta.q_index.shape
    q_pad = torch.cat([q_THD, q_THD.new_zeros(1, H, D)])[meta.q_index]  # [S, Q, H, D]
    k = k_cache.view(-1, kvh, D)[meta.gather_slots]  # [S, K, kvh, D]
    v = v_cache.view(-1, kvh, D)[meta.gather_slots]
    if kvh != H:  # explicit GQA expansion keeps SDPA on its fused kernels
        k = k.repeat_interleave(H // kvh, dim=2)
        v = v.repeat_interleave(H // kvh, dim=2)
    o = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=meta.mask,
        is_causal=meta.mask is None,
        scale=scale,
    )  # [S, H, Q, D]
    return o.transpose(1, 2).reshape(S * Q, H, D)[meta.out_index]
