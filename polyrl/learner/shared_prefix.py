"""Shared-prompt attention: a GRPO group's n responses attend to one copy of their prompt.

In GRPO every prompt is sampled n times, so a packed micro-batch holds the same prompt up to n times, and the trunk
would run each copy forward and backward. With prompt sharing (packing.py, `share_prompts`) the packed row holds each
distinct prompt once, then every response:

    [ prompt_0 | prompt_1 | ... | resp_0,0 | resp_0,1 | ... | resp_1,0 | ... ]     (responses grouped by prompt)

A prompt token attends causally within its prompt; a response token attends to its whole prompt and causally within
its own response. That is exactly the attention of the unshared rows, so log-probs and gradients are the same (the
prompt's gradient is the sum over its responses, which autograd forms because they all read the one copy). Prior art:
"Prefix Grouper" (Liu et al., 2025) applies the same idea to GRPO. At prompt 128 / response 1024 it removes 7/8 of
the prompt tokens, ~10% of the trunk's tokens; at response 256, ~29%.

One flash varlen call computes it. Queries are the packed row's segments as they are; keys and values are gathered
per segment (`kv_index`): a prompt's own rows, and for a response its prompt's rows followed by its own. Flash
attention's causal mask is aligned to the bottom-right when a segment has more keys than queries, so a response's
query i sees the P prompt keys and its own keys 0..i: the mask above. The gathered K/V are small (2 kv heads: 1 KB
per token) and the gather's backward sums the copies' dK/dV back into the prompt rows.

(First tried and measured on an H200: two flash calls, causal over all segments + responses against their prompt,
merged by log-sum-exp with the backward run on the merged output, as ring attention does. Correct, but 9% slower
than unshared attention per layer: the second call's backward allocates, zeroes and converts its own fp32 dQ buffer
over every response token. The gathered single call has no merge and one backward.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gathered_mask(cu_q: torch.Tensor, cu_kv: torch.Tensor, num_kv: int, num_q: int) -> torch.Tensor:
    """[num_q, num_kv] bool for segment-wise attention with the causal diagonal at each segment's bottom-right."""
    dev = cu_q.device
    cu_q, cu_kv = cu_q.long(), cu_kv.long()
    qi, kj = torch.arange(num_q, device=dev), torch.arange(num_kv, device=dev)
    seg_q = torch.searchsorted(cu_q, qi, right=True) - 1
    seg_k = torch.searchsorted(cu_kv, kj, right=True) - 1
    q_pos = qi - cu_q[seg_q]  # position within its segment
    k_pos = kj - cu_kv[seg_k]
    shift = (cu_kv[1:] - cu_kv[:-1]) - (cu_q[1:] - cu_q[:-1])  # keys beyond queries in each segment (the prompt)
    return (seg_q[:, None] == seg_k[None, :]) & (k_pos[None, :] <= q_pos[:, None] + shift[seg_q][:, None])


def shared_prompt_attention(q, k, v, cu, max_len: int, cu_kv, kv_index, max_kv: int, scale: float | None, *,
                            varlen=None) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] laid out as above -> [N, Hq, D]. `cu`: the query segments (prompts, then
    responses); segment s attends to rows `kv_index[cu_kv[s]:cu_kv[s+1]]`, causally from the bottom-right.
    `varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale)`: the flash kernel (CUDA); None: dense-mask SDPA (exact)."""
    k_s, v_s = k.index_select(0, kv_index), v.index_select(0, kv_index)  # backward: index_add (not index_put)
    if varlen is not None:
        return varlen(q, k_s, v_s, cu, cu_kv, max_len, max_kv, scale)
    mask = gathered_mask(cu, cu_kv, k_s.shape[0], q.shape[0])
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k_s, v_s))  # [1, H, N, D]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                         enable_gqa=qh.shape[1] != kh.shape[1])
    return out[0].transpose(0, 1)
