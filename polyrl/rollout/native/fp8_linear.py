"""FP8 weights for the rollout engine's decode GEMMs (`actor_rollout_ref.rollout.quantization=fp8`).

Decode reads every weight once per step, so at small batch the GEMMs are bound by weight bytes; e4m3 weights halve
them. Training never sees this: the trainer keeps bf16 weights with fp32 masters, and every `update_weights`
quantises the incoming tensors row by row straight into the engine's e4m3 storage (`load_rows`), so no bf16 copy of
a quantised weight is kept and a q/k/v or gate/up slice can be written alone.

Scales: one fp32 scale per output channel of the weight (rows of [out, in]), so a weight row is quantised with
its own amax and a slice of rows is independent of the rest; one dynamic scale per token for the activation (computed
in the GEMM's prologue kernel). `torch._scaled_mm` with these row-wise scales runs cuBLASLt's e4m3 GEMM on Hopper.
On CPU the same numbers are emulated in fp32 (quantise, upcast, multiply), which is what CI tests.

Which GEMMs: `FP8_GEMMS` names the layers that run in FP8. `benchmarks/seed_workloads.py --gemms` times each decode
GEMM shape both ways (the activation quantisation included); a GEMM stays in the set only where FP8 wins there.
The LM head and embedding stay in the model dtype: the sampled token's log-prob comes out of the head, and it is the
number rollout correction compares with the trainer's.
"""

from __future__ import annotations

import torch
from torch import nn

from polyrl.rollout.native.attention import FP8, quantize_fp8_rows

FP8_GEMMS = ("qkv", "o", "gate_up", "down")


class FP8Linear(nn.Module):
    """y = x W^T (+ b) with W in e4m3 and one scale per output row; x quantised per token at run time."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        out_f, in_f = linear.weight.shape
        dev = linear.weight.device
        self.out_dtype = linear.weight.dtype
        self.weight = nn.Parameter(torch.zeros(out_f, in_f, dtype=FP8, device=dev), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_f, dtype=torch.float32, device=dev), requires_grad=False)
        self.bias = linear.bias
        self.load_rows(0, out_f, linear.weight.data)

    @torch.no_grad()
    def load_rows(self, lo: int, hi: int, w_rows: torch.Tensor) -> None:
        q, s = quantize_fp8_rows(w_rows.to(self.weight.device))
        self.weight.data[lo:hi].view(torch.uint8).copy_(q.view(torch.uint8))
        self.weight_scale.data[lo:hi].copy_(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.is_cuda:
            y = _scaled_mm_rowwise(x2, self.weight, self.weight_scale, self.bias, self.out_dtype)
        else:
            xq, xs = quantize_fp8_rows(x2)
            w = self.weight.float() * self.weight_scale[:, None]
            y = ((xq.float() * xs[:, None]) @ w.t()).to(self.out_dtype)
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*lead, -1)


def _scaled_mm_rowwise(x_MK, w_NK, w_scale_N, bias, out_dtype):
    from polyrl.rollout.native.fused import quantize_rows_fp8

    xq, xs = quantize_rows_fp8(x_MK)
    return torch._scaled_mm(xq, w_NK.t(), scale_a=xs[:, None], scale_b=w_scale_N[None, :], bias=bias,
                            out_dtype=out_dtype)


def quantize_model(model, gemms=FP8_GEMMS) -> None:
    """Swap the decoder's nn.Linear layers named in `gemms` for FP8Linear, in place (weights quantised now)."""
    for blk in model.layers:
        for parent, name in ((blk.attn, "qkv"), (blk.attn, "o"), (blk.mlp, "gate_up"), (blk.mlp, "down")):
            if name in gemms and isinstance(getattr(parent, name), nn.Linear):
                setattr(parent, name, FP8Linear(getattr(parent, name)))
    model._targets = None  # HF-name targets point at the old modules: rebuilt on the next load
