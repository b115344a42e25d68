"""The LM head's log-probs and entropy with a hand-written backward: chunked GEMMs plus one fused pass per chunk.

`logprobs.chunked_logprobs` with autograd costs, per 2048-row chunk of a 152k vocab, about ten elementwise passes over
the fp32 `[chunk, vocab]` logits (float cast, logsumexp, softmax, product, their backward, the recompute) and one
fp32 `[vocab, hidden]` weight-gradient tensor that autograd then adds into the running gradient. Profiled on an H200
that was ~0.1 s of a 0.79 s actor step. Here each chunk costs:

    forward:  z = h W^T (GEMM, compute dtype)  ->  one pass: online logsumexp, sum p*z, target logit
    backward: z again (GEMM)  ->  one pass writing dL/dz  ->  dh = dz W, dW += dz^T h (GEMMs; dW accumulated in fp32)

Gradients, with s = z / tau, lse = logsumexp(s), H = lse - sum p s, p = softmax(s):
    d logp_y / d s_v = [v == y] - p_v
    d H      / d s_v = -p_v (s_v - lse + H)
and d/dz = d/ds / tau. The per-row passes are Triton kernels on CUDA; elsewhere the same formulas run as torch ops
(the CPU tests check those against autograd, and the GPU test checks the kernels against them).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch formulas below are used
    triton = None


# --------------------------------------------------------------------------------------------- per-row passes (torch)
def _row_stats_torch(z_CV, y_C, temperature: float, with_entropy: bool):
    s = z_CV.float() / temperature
    lse = torch.logsumexp(s, dim=-1)
    logp = s.gather(-1, y_C[:, None]).squeeze(-1) - lse
    ent = lse - (torch.softmax(s, dim=-1) * s).sum(-1) if with_entropy else None
    return logp, lse, ent


def _row_grad_torch(z_CV, y_C, lse_C, ent_C, g_logp_C, g_ent_C, temperature: float):
    s = z_CV.float() / temperature
    lp = s - lse_C[:, None]
    p = lp.exp()
    g = -g_logp_C[:, None] * p
    if g_ent_C is not None:
        g = g - g_ent_C[:, None] * p * (lp + ent_C[:, None])
    g.scatter_add_(-1, y_C[:, None], g_logp_C[:, None])
    return (g / temperature).to(z_CV.dtype)


# --------------------------------------------------------------------------------------------- per-row passes (Triton)
if triton is not None:

    @triton.jit
    def _stats_kernel(z_ptr, y_ptr, logp_ptr, lse_ptr, ent_ptr, V, stride, inv_t, WITH_ENT: tl.constexpr,
                      BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        t = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            scale = tl.exp(m - m_safe)
            e = tl.exp(x - m_safe)
            s = s * scale + e
            if WITH_ENT:
                t = t * scale + tl.where(mask, e * x, 0.0)
            m = m_new
        m_row = tl.max(m, 0)
        lane = tl.exp(m - m_row)
        total = tl.sum(s * lane, 0)
        lse = m_row + tl.log(total)
        y = tl.load(y_ptr + row)
        zy = tl.load(base + y).to(tl.float32) * inv_t
        tl.store(logp_ptr + row, zy - lse)
        tl.store(lse_ptr + row, lse)
        if WITH_ENT:
            tl.store(ent_ptr + row, lse - tl.sum(t * lane, 0) / total)

    @triton.jit
    def _grad_kernel(z_ptr, gz_ptr, y_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, V, stride, inv_t,
                     WITH_ENT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = row.to(tl.int64) * stride
        lse = tl.load(lse_ptr + row)
        g_l = tl.load(glogp_ptr + row)
        y = tl.load(y_ptr + row)
        if WITH_ENT:
            g_e = tl.load(gent_ptr + row)
            h = tl.load(ent_ptr + row)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            lp = tl.load(z_ptr + base + cols, mask=mask, other=0.0).to(tl.float32) * inv_t - lse
            p = tl.exp(lp)
            g = -g_l * p
            if WITH_ENT:
                g = g - g_e * p * (lp + h)
            g = tl.where(cols == y, g + g_l, g) * inv_t
            tl.store(gz_ptr + base + cols, g.to(gz_ptr.dtype.element_ty), mask=mask)


_BLOCK = 4096


def _row_stats(z_CV, y_C, temperature, with_entropy):
    if triton is None or not z_CV.is_cuda:
        return _row_stats_torch(z_CV, y_C, temperature, with_entropy)
    C, V = z_CV.shape
    logp, lse = (torch.empty(C, device=z_CV.device, dtype=torch.float32) for _ in range(2))
    ent = torch.empty_like(lse) if with_entropy else lse
    if C:
        _stats_kernel[(C,)](z_CV, y_C, logp, lse, ent, V, z_CV.stride(0), 1.0 / temperature, WITH_ENT=with_entropy,
                            BLOCK=_BLOCK, num_warps=8)
    return logp, lse, (ent if with_entropy else None)


def _row_grad(z_CV, y_C, lse_C, ent_C, g_logp_C, g_ent_C, temperature):
    if triton is None or not z_CV.is_cuda:
        return _row_grad_torch(z_CV, y_C, lse_C, ent_C, g_logp_C, g_ent_C, temperature)
    C, V = z_CV.shape
    gz = torch.empty_like(z_CV)  # written in place of nothing: z is recomputed per chunk, so it could be reused
    with_ent = g_ent_C is not None
    if C:
        _grad_kernel[(C,)](z_CV, gz, y_C, lse_C, ent_C if with_ent else lse_C, g_logp_C.contiguous(),
                           g_ent_C.contiguous() if with_ent else g_logp_C, V, z_CV.stride(0), 1.0 / temperature,
                           WITH_ENT=with_ent, BLOCK=_BLOCK, num_warps=8)
    return gz


# --------------------------------------------------------------------------------------------- the autograd function
def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    if t.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return t.dtype


_ADDMM_FP32_OUT = [True]  # set False the first time this torch refuses addmm(out_dtype=...): no retry per chunk


def _accumulate_wgrad(acc_VD: torch.Tensor, gz_CV: torch.Tensor, h_CD: torch.Tensor) -> None:
    """acc += gz^T h with fp32 accumulation; on CUDA one GEMM with an fp32 output when torch has it."""
    if acc_VD.dtype != gz_CV.dtype and gz_CV.is_cuda and _ADDMM_FP32_OUT[0]:
        try:
            torch.addmm(acc_VD, gz_CV.t(), h_CD, out_dtype=torch.float32, out=acc_VD)
            return
        except (RuntimeError, TypeError):
            _ADDMM_FP32_OUT[0] = False
    acc_VD.add_(gz_CV.t() @ h_CD)


def _operands(hidden_MD, weight_VD, bias_V):
    """(compute dtype, h, W, b) in the head's compute dtype: autocast's on CUDA under autocast, else the input's."""
    dtype = _compute_dtype(hidden_MD)
    return dtype, hidden_MD.to(dtype), weight_VD.to(dtype), (bias_V.to(dtype) if bias_V is not None else None)


class _HeadGrads:
    """dL/dh, dL/dW (accumulated in fp32) and dL/db of the head, filled from one chunk's dL/dz at a time."""

    def __init__(self, h, weight_VD, need_h: bool, need_w: bool, need_b: bool):
        self.h = torch.empty_like(h) if need_h else None
        self.w = torch.zeros(weight_VD.shape, device=h.device, dtype=torch.float32) if need_w else None
        self.b = torch.zeros(weight_VD.shape[0], device=h.device, dtype=torch.float32) if need_b else None

    def add(self, rows: slice, gz_CV, h_CD, w_VD) -> None:
        if self.h is not None:
            self.h[rows] = gz_CV @ w_VD
        if self.w is not None:
            _accumulate_wgrad(self.w, gz_CV, h_CD)
        if self.b is not None:
            self.b += gz_CV.float().sum(0)

    def result(self, dtypes, scale=None):
        """(dh, dW, db) in the inputs' dtypes (None where not needed), times `scale` if given."""
        return tuple(None if g is None else (g if scale is None else g * scale).to(dt)
                     for g, dt in zip((self.h, self.w, self.b), dtypes))


class _FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_MD, weight_VD, bias_V, targets_M, temperature, with_entropy, chunk_size):
        dtype, h, w, b = _operands(hidden_MD, weight_VD, bias_V)
        M = h.shape[0]
        logp = torch.empty(M, device=h.device, dtype=torch.float32)
        lse, ent = torch.empty_like(logp), (torch.empty_like(logp) if with_entropy else None)
        with torch.autocast(h.device.type, enabled=False):
            for a in range(0, M, chunk_size):
                z = torch.nn.functional.linear(h[a:a + chunk_size], w, b)
                lp, ls, en = _row_stats(z, targets_M[a:a + chunk_size], temperature, with_entropy)
                logp[a:a + chunk_size], lse[a:a + chunk_size] = lp, ls
                if with_entropy:
                    ent[a:a + chunk_size] = en
        ctx.save_for_backward(h, weight_VD, bias_V, targets_M, lse, ent if with_entropy else lse)
        ctx.cfg = (temperature, with_entropy, chunk_size, hidden_MD.dtype)
        return (logp, ent) if with_entropy else (logp, None)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, weight_VD, bias_V, targets, lse, ent = ctx.saved_tensors
        temperature, with_entropy, chunk_size, hidden_dtype = ctx.cfg
        w = weight_VD.to(h.dtype)  # h was saved in the forward's compute dtype
        b = bias_V.to(h.dtype) if bias_V is not None else None
        g_logp = g_logp.float() if g_logp is not None else torch.zeros_like(lse)
        g_ent = g_ent.float() if (with_entropy and g_ent is not None) else None
        grads = _HeadGrads(h, weight_VD, *ctx.needs_input_grad[:3])
        with torch.autocast(h.device.type, enabled=False):
            for a in range(0, h.shape[0], chunk_size):
                sl = slice(a, a + chunk_size)
                z = torch.nn.functional.linear(h[sl], w, b)
                gz = _row_grad(z, targets[sl], lse[sl], ent[sl] if g_ent is not None else None, g_logp[sl],
                               g_ent[sl] if g_ent is not None else None, temperature)
                del z
                grads.add(sl, gz, h[sl], w)
        dtypes = (hidden_dtype, weight_VD.dtype, bias_V.dtype if bias_V is not None else None)
        return (*grads.result(dtypes), None, None, None, None)


class _FusedHeadGradInForward(torch.autograd.Function):
    """The head's backward run inside its forward, for a loss whose gradient w.r.t. each log-prob (and entropy) is
    known before the forward: per chunk one logits GEMM instead of two. Returns (logp, entropy, anchor): logp and
    entropy carry no gradient; `anchor` is a zero scalar whose backward delivers dL/dh, dL/dW, dL/db (scaled by the
    gradient it receives)."""

    @staticmethod
    def forward(ctx, hidden_MD, weight_VD, bias_V, targets_M, g_logp_M, g_ent_M, temperature, with_entropy,
                chunk_size):
        _, h, w, b = _operands(hidden_MD, weight_VD, bias_V)
        M = h.shape[0]
        stats_ent = with_entropy or g_ent_M is not None
        logp = torch.empty(M, device=h.device, dtype=torch.float32)
        ent = torch.empty_like(logp) if stats_ent else logp.new_empty(0)
        grads = _HeadGrads(h, weight_VD, True, True, b is not None)
        with torch.autocast(h.device.type, enabled=False):
            for a in range(0, M, chunk_size):
                sl = slice(a, a + chunk_size)
                z = torch.nn.functional.linear(h[sl], w, b)
                lp, lse, en = _row_stats(z, targets_M[sl], temperature, stats_ent)
                logp[sl] = lp
                if stats_ent:
                    ent[sl] = en
                g_ent = g_ent_M[sl].float() if g_ent_M is not None else None
                gz = _row_grad(z, targets_M[sl], lse, en if g_ent is not None else None, g_logp_M[sl].float(), g_ent,
                               temperature)
                del z
                grads.add(sl, gz, h[sl], w)
        ctx.grads = grads
        ctx.dtypes = (hidden_MD.dtype, weight_VD.dtype, bias_V.dtype if bias_V is not None else None)
        ctx.mark_non_differentiable(logp, ent)
        return logp, ent, logp.new_zeros(())

    @staticmethod
    def backward(ctx, _g_logp, _g_ent, g_anchor):
        grads = ctx.grads
        del ctx.grads
        return (*grads.result(ctx.dtypes, g_anchor), None, None, None, None, None, None)


def fused_logprobs_grad_in_forward(hidden_MD: torch.Tensor, weight_VD: torch.Tensor, targets_M: torch.Tensor,
                                   g_logp_M: torch.Tensor, g_ent_M: torch.Tensor | None = None, *,
                                   bias_V: torch.Tensor | None = None, temperature: float = 1.0,
                                   with_entropy: bool = False, chunk_size: int = 2048):
    """Log-probs (and entropy) of `fused_logprobs`, without gradient, plus a zero `anchor` scalar: `anchor.backward()`
    applies the gradient of `sum(g_logp * logp + g_ent * entropy)` to hidden, weight and bias. Valid when those
    per-token coefficients do not depend on the log-probs' values (the on-policy single pass: actor.py)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1; use e.g. 2048 rows per LM-head chunk.")
    logp, ent, anchor = _FusedHeadGradInForward.apply(hidden_MD, weight_VD, bias_V, targets_M, g_logp_M, g_ent_M,
                                                      float(temperature), with_entropy, chunk_size)
    return logp, (ent if with_entropy else None), anchor


def fused_logprobs(hidden_MD: torch.Tensor, weight_VD: torch.Tensor, targets_M: torch.Tensor, *,
                   bias_V: torch.Tensor | None = None, temperature: float = 1.0, with_entropy: bool = False,
                   chunk_size: int = 2048):
    """Same contract as `logprobs.chunked_logprobs` (fp32 results); backward by hand, see the module docstring."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1; use e.g. 2048 rows per LM-head chunk.")
    return _FusedHead.apply(hidden_MD, weight_VD, bias_V, targets_M, float(temperature), with_entropy, chunk_size)
