"""FP8 weights for the rollout engine's decode GEMMs (`actor_rollout_ref.rollout.quantization=fp8`).

Decode reads every weight once per step, so at small batch the GEMMs are bound by weight bytes; e4m3 weights halve
them. Training never sees this: the trainer keeps bf16 weights with fp32 masters, and every `update_weights`
quantises the incoming tensors row by row straight into the engine's e4m3 storage (`load_rows`), so no bf16 copy of
a quantised weight is kept and a q/k/v or gate/up slice can be written alone.

Scales: one fp32 scale per output channel of the weight (rows of [out, in]), so a weight row is quantised with
its own amax and a slice of rows is independent of the rest; one dynamic scale per token for the activation (computed
in the GEMM's prologue kernel). `torch._scaled_mm` with these row-wise scales runs cuBLASLt's e4m3 GEMM on Hopper.
On CPU the same numbers are emulated in fp32 (quantise, upcast, multiply), which is what CI tests.

Which GEMMs: `benchmarks/seed_workloads.py --gemms` times each decode GEMM both ways (CUDA graphs, H100). A layer
runs in FP8 when its weight has more than 2^23 elements (`MIN_FP8_ELEMENTS`; at 1.5B gate_up and down, at 8B all
four); the rest stay bf16. With cold weights, as the engine reads them (1.5B, 1-64 rows, H100, 2026-11-26):
  bf16 cuBLAS: qkv 5.7-6.0 us, o 5.4-5.6, gate_up 22.6-24.6 (76-82% of copy bandwidth), down 14.7-15.8;
  `_scaled_mm` on fed e4m3 rows: qkv 7.5, o 7.3, gate_up 17.1-18.8, down 23.5 (cuBLASLt's 128-wide tiles leave
  down's N = 1536 on 12 programs);
  splitk_fp8.py on fed rows (launch table): qkv 5.9-7.2, o 5.5-6.8, gate_up 12.2-14.1 (67-76%), down 9.7-12.8.
So with the split-K kernel down wins in FP8 too, and qkv / o are launch-bound either way. The line was 2^24 (gate_up
alone) while down went through `_scaled_mm` past 64 rows; with down on split-K up to 256 rows (`splitk_serves`) the
2^23 line gave s1 8,641 tok/s against 8,444 and shape (a) (256 rows) 67,547 against 66,743 (H100, 2026-11-26).
The producing kernels (add_rmsnorm, silu_mul) hand an FP8 GEMM its input as `FP8Rows`, quantised in their own pass
(`takes_fp8_rows`): s1 8,219 against 8,168 tok/s with `_scaled_mm` (H100,
2026-11-26).
At 129-256 fed rows the 1.5B gate_up runs `wave_fp8.py` (one program per SM, the leftover columns as a narrow second
dot: 19.8 against `_scaled_mm`'s 21.2 us at 256 rows, whose 140 tiles take two waves of 132 SMs).
At 1-16 rows a bf16 input (a layer whose producer does not quantise, or FUSED_INPUT off) runs `w8a16.py`'s Triton
kernel, which reads the e4m3 weight once and keeps the activation in bf16; past that, `_scaled_mm`.
The LM head and embedding stay in the model dtype by default: the sampled token's log-prob comes out of the head, and
it is the number rollout correction compares with the trainer's. `engine_kwargs.native.fp8_lm_head=True` (a recipe)
puts the head in FP8 too: s1 8,819 tok/s against 8,639, and the quickstart learns as well (H100, 2026-11-26).
"""

from __future__ import annotations

import torch
from torch import nn

from polyrl.rollout.native.attention import FP8, FP8Rows, quantize_fp8_rows

FP8_GEMMS = ("qkv", "o", "gate_up", "down")
MIN_FP8_ELEMENTS = 1 << 23  # the size line (module docstring)
# the producing kernel (add_rmsnorm / silu_mul) quantises an FP8 GEMM's input in its own pass (`takes_fp8_rows`):
# +0.6% on s1 (H100). Off only in the invariance test that compares both (tests/test_fused_fp8_input_interp_on_cpu.py)
FUSED_INPUT = True
W8A16_MAX_ROWS = 16  # at most this many rows (decode's long tail) run w8a16.py's kernel: x stays unquantised
# Decode GEMMs fed `FP8Rows` run splitk_fp8.py (K split so every GEMM covers the GPU, partials reduced in the same
# launch) at <= SPLITK_MAX_ROWS rows, and past that the weights in SPLITK_WIDE (`splitk_serves`): s1 8,444 tok/s
# against 8,220 (H100, 2026-11-26). `engine_kwargs.native.fp8_splitk=False` (FP8Linear.splitk, a fallback from the
# Triton kernel) goes back to w8a16 (bf16 x) at <= 16 rows and `_scaled_mm` above.
SPLITK_MAX_ROWS = 64
# Past SPLITK_MAX_ROWS (row blocks of 64, each rereading the weight) only where measured to win: weight (N, K) -> up
# to this many rows (`splitk_serves`)
# the 1.5B and 8B down projections, and the 1.5B gate_up to 128 rows (a 128-row tile: 16.0 us against `_scaled_mm`'s
# 19.2, `seed_workloads.py --gemms --gemm-partials`, H100, 2026-11-26; at 256 rows 23.3 against 23.4, so not there)
SPLITK_WIDE = {(1536, 8960): 256, (4096, 14336): 128, (17920, 1536): 128}
# The LLM engine's `_scaled_mm` GEMMs on fed rows (past the split-K kernel's rows, and prefill) accumulate as the tensor cores do
# (`use_fast_accum`), as Triton's FP8 dots in splitk_fp8.py / w8a16.py do by default on sm_90; the DiT's GEMMs (bf16 x)
# keep cuBLASLt's promoted accumulation. `--gemms --gemm-partials --gemm-fast-accum` (H100, cold weights, 2026-11-26):
# the 1.5B gate_up 20.9 against 23.7 us at 256 rows, prefill sizes (2k-8k rows) 3-15% faster at both shapes; (a) in
# FP8 KV + W8 71,909 against 69,995 tok/s (same call), s2 6,137 against 6,179 (noise); learning unchanged (3 seeds).
# FP8 GEMMs whose K split goes to the consumer: the split-K kernel returns each split's scaled partial product,
# [split, T, N], and the add_rmsnorm after a down projection sums them (`partials_config`), instead of the kernel's
# in-launch reduction (the last program of each output tile reads every partial). (N, K) -> {rows rounded up to a
# power of two: launch config}, the best of `seed_workloads.py --gemms --gemm-partials` (cold weights, H100,
# 2026-11-26), against the in-launch reduction: the 1.5B down 7.6 / 7.9 / 8.3 / 9.1 / 11.9 us at 16 / 32 / 64 / 128 /
# 256 rows against 10.0 / 10.8 / 12.6 / 13.6 / 16.9; the 8B down 22.6 / 23.0 / 23.8 / 25.9 at 16 / 32 / 64 / 128
# against 26.1 / 27.7 / 30.9 / 34.8. add_rmsnorm over 2-4 partials costs 0.1-0.5 us more than over one tensor.
# (a) in FP8 KV + W8: 69,703 tok/s against 66,871 (same call). An empty table is the in-launch reduction everywhere
# (tests/test_fp8_rollout_gpu.py compares the two).
_W = dict(BN=64, BK=256, num_warps=4, num_stages=4)
PARTIALS = {(1536, 8960): {16: dict(_W, BM=16, split=4), 32: dict(_W, BM=32, split=4), 64: dict(_W, BM=64, split=4),
                           128: dict(_W, BM=128, split=4), 256: dict(_W, BM=128, split=2)},
            (4096, 14336): {16: dict(_W, BM=16, split=2), 32: dict(_W, BM=32, split=2), 64: dict(_W, BM=64, split=2),
                            128: dict(_W, BM=128, split=2)}}
# With the partials, silu_mul quantises its output with one scale per (K split of the down GEMM, row), not per row
# (`partials_slice`): one program per slice of a row instead of per row, and finer scales. H100, A/B one process each
# (2026-11-27): (a) fp8kv_w8 decode 3.37-3.41 s against 3.40-3.46 s of GPU time; s1 at 64 sequences 9,320 against
# 9,258 tok/s; learning unchanged (fp8_quickstart.py, 3 seeds: 100 / 100 / 100).
# Inside torch.compile (the DiT's compiled blocks) the activation is quantised with plain tensor ops, which inductor
# fuses into the kernel that produced it, instead of the hand-written Triton launch (`_scaled_mm_rowwise`)
COMPILED_QUANTISER = "inductor"  # or "triton": benchmarks/probes/flow_fp8_rollout.py --compiled-quantisers compares them


class FP8Linear(nn.Module):
    """y = x W^T (+ b) with W in e4m3 and one scale per output row; x quantised per token at run time."""

    def __init__(self, linear: nn.Linear, splitk: bool = True):
        super().__init__()
        self.splitk = splitk  # fed e4m3 rows may run splitk_fp8.py (engine_kwargs.native.fp8_splitk)
        out_f, in_f = linear.weight.shape
        dev = linear.weight.device
        self.out_dtype = linear.weight.dtype
        # rows padded with zeros to a multiple of 16 (`_scaled_mm`'s alignment; e.g. a 104-token vocabulary's head)
        self.out_features, self.pad = out_f, -out_f % 16
        self.weight = nn.Parameter(torch.zeros(out_f + self.pad, in_f, dtype=FP8, device=dev), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_f + self.pad, dtype=torch.float32, device=dev),
                                         requires_grad=False)
        self.bias = linear.bias
        self.load_rows(0, out_f, linear.weight.data)

    @torch.no_grad()
    def load_rows(self, lo: int, hi: int, w_rows: torch.Tensor) -> None:
        q, s = quantize_weight_rows(w_rows.to(self.weight.device))
        self.weight.data[lo:hi].view(torch.uint8).copy_(q.view(torch.uint8))
        self.weight_scale.data[lo:hi].copy_(s)

    def partials(self, x: FP8Rows, config: dict) -> torch.Tensor:
        """x W^T as the split-K kernel's [split, T, N] partial products (`partials_config`), for a consumer that sums
        them."""
        from polyrl.rollout.native.splitk_fp8 import splitk_fp8_matmul

        return splitk_fp8_matmul(x, self.weight, self.weight_scale, None, self.out_dtype, config, partials=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.pad:
            return fp8_matmul(x, self.weight, self.weight_scale, self.bias, self.out_dtype, self.splitk)
        y = fp8_matmul(x, self.weight, self.weight_scale, None, self.out_dtype, self.splitk)[..., : self.out_features]
        y = y.contiguous()
        return y if self.bias is None else y + self.bias


def quantize_weight_rows(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's e4m3 rows and fp32 scales (`quantize_fp8_rows`), made at every weight update. On CUDA one Triton
    launch reads the weight once and writes the bytes; the tensor-op version makes three fp32 copies of it, which took
    0.25-0.42 s for Qwen-Image's 20.4B before each rollout (`timing_s/fp8_quantise`, H200, 2026-11-25/26). Triton
    divides by the scale to within 2 fp32 ulp, not IEEE-rounded, so a value on an e4m3 rounding tie may land one step
    off the tensor-op result (tests/test_fp8_rollout_gpu.py)."""
    if w_NK.is_cuda and w_NK.dim() == 2:
        from polyrl.rollout.native.fused import quantize_fp8_rows_triton

        return quantize_fp8_rows_triton(w_NK)
    return quantize_fp8_rows(w_NK)


def fp8_matmul(x: torch.Tensor, w_NK: torch.Tensor, w_scale_N: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype, splitk: bool = True) -> torch.Tensor:
    """x W^T (+ b) with W in e4m3 rows (`quantize_fp8_rows`) and x quantised per token here: `_scaled_mm` on CUDA,
    the same numbers emulated in fp32 elsewhere. The one FP8 GEMM of the LLM engine and the DiT's rollout. x may come
    quantised already (`FP8Rows`, [T, K], from a fused producer): then this is the GEMM alone, on the split-K kernel
    where it serves unless `splitk` is False."""
    if isinstance(x, FP8Rows):
        if x.q.is_cuda and splitk and splitk_serves(x.q.shape[0], *w_NK.shape):
            from polyrl.rollout.native.splitk_fp8 import splitk_fp8_matmul

            return splitk_fp8_matmul(x, w_NK, w_scale_N, bias, out_dtype)
        if x.q.is_cuda and bias is None and x.scale.dim() == 1:
            from polyrl.rollout.native import wave_fp8

            if wave_fp8.serves(x.q.shape[0], *w_NK.shape, x.q.device):
                return wave_fp8.one_wave_fp8_matmul(x, w_NK, w_scale_N, out_dtype)
        return _rows_matmul(x.q, x.scale, w_NK, w_scale_N, bias, out_dtype, fast_accum=True)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.is_cuda and x2.shape[0] <= W8A16_MAX_ROWS:  # a decode step of few sequences: one pass over e4m3 bytes
        from polyrl.rollout.native.w8a16 import w8a16_matmul

        y = w8a16_matmul(x2, w_NK, w_scale_N, bias, out_dtype)
    else:
        y = _scaled_mm_rowwise(x2, w_NK, w_scale_N, bias, out_dtype)
    return y.reshape(*lead, -1)


def splitk_serves(rows: int, n: int, k: int) -> bool:
    """Whether the split-K kernel runs an FP8 GEMM of `rows` fed rows and an [n, k] weight: always at <= 64 rows,
    past that where SPLITK_WIDE says it won. Cold weights, H100, 96-256 rows: the 1.5B down (cuBLASLt's 128 x 128
    tiles: 12-24 programs) 13.7-16.5 us against `_scaled_mm`'s 23.7 and bf16's 16.7-18.5; the 8B down 33.0 against
    36.5 at 96-128 rows but 66.7 against 39.8 at 256 (its 58 MB weight, reread by each row block, is past the L2). Where
    `_scaled_mm` has tiles for every SM it is as fast or faster: the 1.5B gate_up 18.8-22.9 us against split-K's
    18.3-28.0, the 8B qkv 15.0-16.4 against 17.7-22.1, the 8B o 13.8-13.9 against 14.4-23.5."""
    return rows <= SPLITK_MAX_ROWS or rows <= SPLITK_WIDE.get((n, k), 0)


def partials_config(linear: nn.Module, rows: int) -> dict | None:
    """The split-K launch config (with its split) under which this FP8 layer hands its partial products to the
    consumer at `rows` fed rows (`FP8Linear.partials`; PARTIALS), or None: one output tensor."""
    if not (isinstance(linear, FP8Linear) and linear.bias is None and not linear.pad and linear.weight.is_cuda
            and linear.splitk and takes_fp8_rows(linear, rows)):
        return None
    return partials_entry(rows, *linear.weight.shape)


def partials_slice(linear: FP8Linear, rows: int, config: dict) -> int | None:
    """The columns of each K split of `linear.partials(x, config)`, for the producer of x to make one scale per
    (split, row) (`fused.silu_mul`'s slice_cols)."""
    from polyrl.rollout.native.attention import sm_count
    from polyrl.rollout.native.splitk_fp8 import k_slices

    return k_slices(rows, *linear.weight.shape, config, sm_count(linear.weight.device))


def partials_entry(rows: int, n: int, k: int) -> dict | None:
    """PARTIALS' launch config for `rows` rows of an [n, k] weight (rows rounded up to a power of two, at least 16)."""
    return PARTIALS.get((n, k), {}).get(max(16, 1 << (rows - 1).bit_length()))


def takes_fp8_rows(linear: nn.Module, rows: int) -> bool:
    """Whether the kernel producing this layer's input should hand it over as `FP8Rows` (FUSED_INPUT on, an FP8
    layer): at every row count with the split-K kernel; without it (`fp8_splitk=False`) past W8A16_MAX_ROWS only,
    as w8a16 reads x unquantised."""
    return FUSED_INPUT and isinstance(linear, FP8Linear) and (linear.splitk or rows > W8A16_MAX_ROWS)


def _scaled_mm_rowwise(x_MK, w_NK, w_scale_N, bias, out_dtype):
    """x quantised per token, then the GEMM: the Triton quantiser on CUDA, tensor ops on CPU or inside torch.compile
    (COMPILED_QUANTISER "inductor")."""
    if x_MK.is_cuda and not (torch.compiler.is_compiling() and COMPILED_QUANTISER == "inductor"):
        from polyrl.rollout.native.fused import quantize_fp8_rows_triton

        xq, xs = quantize_fp8_rows_triton(x_MK)
    else:
        xq, xs = quantize_fp8_rows(x_MK)
    return _rows_matmul(xq, xs, w_NK, w_scale_N, bias, out_dtype)


def _rows_matmul(xq_MK, xs_M, w_NK, w_scale_N, bias, out_dtype, fast_accum: bool = False):
    """The GEMM of e4m3 rows with their scales: `_scaled_mm` on CUDA, the same numbers in fp32 elsewhere.
    `fast_accum`: the tensor cores' own FP8 accumulation, without cuBLASLt's periodic promotion to fp32 (the engine's
    fed rows; measured above)."""
    if xq_MK.is_cuda:
        return torch._scaled_mm(xq_MK, w_NK.t(), scale_a=xs_M[:, None], scale_b=w_scale_N[None, :], bias=bias,
                                out_dtype=out_dtype, use_fast_accum=fast_accum)  # fmt: skip
    y = ((xq_MK.float() * xs_M[:, None]) @ (w_NK.float() * w_scale_N[:, None]).t()).to(out_dtype)
    return y if bias is None else y + bias


def quantize_model(model, gemms=FP8_GEMMS, min_elements: int | None = None, lm_head: bool = False,
                   splitk: bool = True) -> None:
    """Swap the decoder's nn.Linear layers named in `gemms` whose weight has more than `min_elements` elements (the
    measured crossover on CUDA; every named layer on CPU, so CI exercises them all) for FP8Linear, in place; the LM
    head too with `lm_head` (a recipe: the sampled tokens' log-probs then come from e4m3 logits, which rollout
    correction weighs against the trainer's). `splitk`: FP8Linear.splitk of every swapped layer."""
    if lm_head:  # a tied head gets an e4m3 copy of the embedding, refreshed when the embedding loads
        head = model.lm_head
        if head is None:
            head = nn.Linear(model.spec.hidden_size, model.spec.vocab_size, bias=False, device="meta")
            head.weight = model.embed.weight
        model.lm_head = FP8Linear(head, splitk)
    if min_elements is None:
        min_elements = MIN_FP8_ELEMENTS if model.embed.weight.is_cuda else 0
    from polyrl.rollout.native.moe import quantize_experts

    for blk in model.layers:
        mlp = getattr(blk.mlp, "shared", None) or blk.mlp  # a MoE layer: its shared expert (the experts: below)
        for parent, name in ((blk.attn, "qkv"), (blk.attn, "o"), (mlp, "gate_up"), (mlp, "down")):
            lin = getattr(parent, name, None)
            if name in gemms and isinstance(lin, nn.Linear) and lin.weight.numel() > min_elements:
                fp8 = FP8Linear(lin, splitk)
                fp8._forward_hooks.update(lin._forward_hooks)  # tensor_parallel.py's all-reduce stays on the layer
                setattr(parent, name, fp8)
    if {"gate_up", "down"} <= set(gemms):
        quantize_experts(model)
    model._targets = None  # HF-name targets point at the old modules: rebuilt on the next load
