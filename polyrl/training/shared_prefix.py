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
  B. each response (queries) against its prompt's keys, no mask;
  out = (e^lse_A out_A + e^lse_B out_B) / (e^lse_A + e^lse_B) on response rows (one Triton pass on CUDA).
B runs per response, against a per-response copy of its prompt's K/V (`kv_index`: 128 rows x 2 kv heads is a few
KB per response), not per group: flash-attention's backward parallelises over key blocks, and one 128-token prompt
per group would leave most SMs idle while each walked all of its group's ~8k queries. The copies' dK/dV are summed
back into the prompt rows. Backward runs flash-attention's backward for A and B with the *merged* output and
log-sum-exp (what ring attention does): each call then yields exactly its keys' share of the gradient.

`shared_prompt_attention` uses the flash kernels inside torch on CUDA (custom ops, opaque to torch.compile) and an
exact dense-mask SDPA elsewhere (CPU tests; O(N^2) memory).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the dense path needs no kernel
    triton = None


if triton is not None:

    @triton.jit
    def _merge_kernel(OA, OB, LA, LB, R, stride_la, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        # rows (response token r, head h) flattened as r * H + h; OA/OB [R, H, D]; LA [H, stride_la] (a view into
        # the full lse), LB [H, R]. Writes the merged output into OA and the merged lse into LA.
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < R * H
        r, h = i // H, i % H
        la = tl.load(LA + h * stride_la + r, mask=ok, other=0.0)
        lb = tl.load(LB + h * R + r, mask=ok, other=0.0)
        mx = tl.maximum(la, lb)
        ea, eb = tl.exp(la - mx), tl.exp(lb - mx)
        total = ea + eb
        d = tl.arange(0, D)
        ptr = i[:, None] * D + d[None, :]
        oa = tl.load(OA + ptr, mask=ok[:, None], other=0.0).to(tl.float32)
        ob = tl.load(OB + ptr, mask=ok[:, None], other=0.0).to(tl.float32)
        out = (oa * (ea / total)[:, None] + ob * (eb / total)[:, None]).to(OA.dtype.element_ty)
        tl.store(OA + ptr, out, mask=ok[:, None])
        tl.store(LA + h * stride_la + r, mx + tl.log(total), mask=ok)


def _merge(out_a, lse_a, out_b, lse_b) -> None:
    """In place: out_a/lse_a (views of the response rows) become the softmax-weighted merge with out_b/lse_b."""
    if triton is not None and out_a.is_cuda and out_a.is_contiguous() and out_b.is_contiguous():
        R, H, D = out_a.shape
        BLOCK = 32
        _merge_kernel[(triton.cdiv(R * H, BLOCK),)](out_a, out_b, lse_a, lse_b.contiguous(), R, lse_a.stride(0),
                                                   H=H, D=D, BLOCK=BLOCK, num_warps=4)
        return
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).t().unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).t().unsqueeze(-1)
    out_a.copy_((w_a * out_a.float() + w_b * out_b.float()).to(out_a.dtype))
    lse_a.copy_(lse)


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
                cu_k: torch.Tensor, kv_index: torch.Tensor, max_len: int, num_prompt: int, max_q: int, max_k: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    n = num_prompt
    out, lse = _flash_fwd(q, k, v, cu, cu, max_len, max_len, True, scale)
    out_b, lse_b = _flash_fwd(q[n:], k[kv_index], v[kv_index], cu_q, cu_k, max_q, max_k, False, scale)
    _merge(out[n:], lse[:, n:], out_b, lse_b)
    return out, lse


@_shared_fwd.register_fake
def _(q, k, v, cu, cu_q, cu_k, kv_index, max_len, num_prompt, max_q, max_k, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("polyrl::shared_prompt_attn_backward", mutates_args=())
def _shared_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, cu: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, kv_index: torch.Tensor,
                max_len: int, num_prompt: int, max_q: int, max_k: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dout = dout.contiguous()
    dq, dk, dv = _flash_bwd(dout, q, k, v, out, lse, cu, cu, max_len, max_len, True, scale)
    n = num_prompt
    dq_b, dk_b, dv_b = _flash_bwd(dout[n:], q[n:], k[kv_index], v[kv_index], out[n:], lse[:, n:].contiguous(),
                                  cu_q, cu_k, max_q, max_k, False, scale)
    dq[n:] += dq_b
    dk.index_add_(0, kv_index, dk_b)
    dv.index_add_(0, kv_index, dv_b)
    return dq, dk, dv


@_shared_bwd.register_fake
def _(dout, q, k, v, out, lse, cu, cu_q, cu_k, kv_index, max_len, num_prompt, max_q, max_k, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu, cu_q, cu_k, kv_index, max_len, num_prompt, max_q, max_k, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu, cu_q, cu_k, kv_index)
    ctx.ints = (max_len, num_prompt, max_q, max_k, scale)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu, cu_q, cu_k, kv_index = ctx.saved_tensors
    dq, dk, dv = _shared_bwd(dout, q, k, v, out, lse, cu, cu_q, cu_k, kv_index, *ctx.ints)
    return (dq, dk, dv) + (None,) * 9


_shared_fwd.register_autograd(_backward, setup_context=_setup)


def dense_mask(num_tokens: int, cu: torch.Tensor, num_prompt: int, cu_q: torch.Tensor, cu_k: torch.Tensor,
               kv_index: torch.Tensor, device) -> torch.Tensor:
    """[N, N] bool: may token i attend token j (causal within a segment, plus response -> its prompt's rows)."""
    idx = torch.arange(num_tokens, device=device)
    seg = torch.searchsorted(cu.to(device).long(), idx, right=True)
    allowed = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    num_resp = len(cu_q) - 1
    sees = torch.zeros(num_resp, num_tokens, dtype=torch.bool, device=device)  # response r -> its prompt rows
    owner = torch.searchsorted(cu_k.to(device).long(), torch.arange(len(kv_index), device=device), right=True) - 1
    sees[owner, kv_index.to(device)] = True
    resp_of = torch.searchsorted(cu_q.to(device).long(), (idx - num_prompt).clamp(min=0), right=True) - 1
    cross = sees[resp_of.clamp(max=num_resp - 1)] & (idx[:, None] >= num_prompt)
    return allowed | cross


def shared_prompt_attention(q, k, v, cu, max_len: int, num_prompt: int, cu_q, cu_k, kv_index, max_q: int,
                            max_k: int, scale: float | None, *, use_flash: bool) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] laid out as above -> [N, Hq, D]. `cu`: every segment (prompts, then responses);
    `cu_q`: each response (offsets from `num_prompt`); `kv_index`/`cu_k`: the prompt rows response r attends to are
    `kv_index[cu_k[r]:cu_k[r+1]]`."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if use_flash:
        out, _ = _shared_fwd(q, k, v, cu, cu_q, cu_k, kv_index, max_len, num_prompt, max_q, max_k, scale)
        return out
    mask = dense_mask(q.shape[0], cu, num_prompt, cu_q, cu_k, kv_index, q.device)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, N, D]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                         enable_gqa=qh.shape[1] != kh.shape[1])
    return out[0].transpose(0, 1)
