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

The mask is not block-diagonal, so one flash varlen call cannot express it. Two calls and an exact merge can:
  A. causal varlen over all segments (each prompt, each response on its own);
  B. the responses of group g (queries) against prompt g (keys), no mask;
  out = (e^lse_A out_A + e^lse_B out_B) / (e^lse_A + e^lse_B) on response rows.
Backward runs flash-attention's backward for A and B with the *merged* output and log-sum-exp (what ring attention
does): each call then yields exactly its keys' share of the gradient, and the two dq parts add up.

`shared_prompt_attention` uses the flash kernels inside torch on CUDA (custom ops, opaque to torch.compile) and an
exact dense-mask SDPA elsewhere (CPU tests; O(N^2) memory).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _flash_fwd(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                       scale=scale)[:2]
    return out, lse  # [N, Hq, D], [Hq, N] fp32


def _flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout is 0: the philox state is never read
    unused = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                                    rng, unused, scale=scale)


@torch.library.custom_op("polyrl::shared_prompt_attn", mutates_args=())
def _shared_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, cu_q: torch.Tensor,
                cu_k: torch.Tensor, max_len: int, num_prompt: int, max_q: int, max_k: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _flash_fwd(q, k, v, cu, cu, max_len, max_len, True, scale)
    out_b, lse_b = _flash_fwd(q[num_prompt:], k[:num_prompt], v[:num_prompt], cu_q, cu_k, max_q, max_k, False, scale)
    lse_a = lse[:, num_prompt:]
    lse_r = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse_r).t().unsqueeze(-1)  # [N_resp, Hq, 1]
    w_b = torch.exp(lse_b - lse_r).t().unsqueeze(-1)
    out[num_prompt:] = (w_a * out[num_prompt:].float() + w_b * out_b.float()).to(out.dtype)
    lse[:, num_prompt:] = lse_r
    return out, lse


@_shared_fwd.register_fake
def _(q, k, v, cu, cu_q, cu_k, max_len, num_prompt, max_q, max_k, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("polyrl::shared_prompt_attn_backward", mutates_args=())
def _shared_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, cu: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_len: int,
                num_prompt: int, max_q: int, max_k: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dout = dout.contiguous()
    dq, dk, dv = _flash_bwd(dout, q, k, v, out, lse, cu, cu, max_len, max_len, True, scale)
    n = num_prompt
    dq_b, dk_b, dv_b = _flash_bwd(dout[n:], q[n:], k[:n], v[:n], out[n:], lse[:, n:].contiguous(), cu_q, cu_k,
                                  max_q, max_k, False, scale)
    dq[n:] += dq_b
    dk[:n] += dk_b
    dv[:n] += dv_b
    return dq, dk, dv


@_shared_bwd.register_fake
def _(dout, q, k, v, out, lse, cu, cu_q, cu_k, max_len, num_prompt, max_q, max_k, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu, cu_q, cu_k, max_len, num_prompt, max_q, max_k, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu, cu_q, cu_k)
    ctx.ints = (max_len, num_prompt, max_q, max_k, scale)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _shared_bwd(dout, q, k, v, out, lse, cu, cu_q, cu_k, *ctx.ints)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_shared_fwd.register_autograd(_backward, setup_context=_setup)


def dense_mask(num_tokens: int, cu: torch.Tensor, num_prompt: int, cu_q: torch.Tensor, cu_k: torch.Tensor,
               device) -> torch.Tensor:
    """[N, N] bool: may token i attend token j (causal within a segment, plus response -> its group's prompt)."""
    idx = torch.arange(num_tokens, device=device)
    seg = torch.searchsorted(cu.to(device).long(), idx, right=True)
    allowed = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    group_q = torch.searchsorted(cu_q.to(device).long(), idx - num_prompt, right=True)  # responses' group
    group_k = torch.searchsorted(cu_k.to(device).long(), idx, right=True)  # prompts' group
    cross = (idx[:, None] >= num_prompt) & (idx[None, :] < num_prompt) & (group_q[:, None] == group_k[None, :])
    return allowed | cross


def shared_prompt_attention(q, k, v, cu, max_len: int, num_prompt: int, cu_q, cu_k, max_q: int, max_k: int,
                            scale: float | None, *, use_flash: bool) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] laid out as above -> [N, Hq, D]. `cu`: every segment (prompts, then responses);
    `cu_q`/`cu_k`: per group, its responses (offsets from `num_prompt`) and its prompt."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if use_flash:
        out, _ = _shared_fwd(q, k, v, cu, cu_q, cu_k, max_len, num_prompt, max_q, max_k, scale)
        return out
    mask = dense_mask(q.shape[0], cu, num_prompt, cu_q, cu_k, q.device)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, N, D]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                         enable_gqa=qh.shape[1] != kh.shape[1])
    return out[0].transpose(0, 1)
