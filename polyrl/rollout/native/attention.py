"""Attention over the paged KV cache, two ways.

- `decode` on CUDA: a Triton paged-decode kernel (`paged_decode.py`) reads each sequence's K/V blocks straight from
  the cache through a block table. One program per (sequence, kv head, split); the q heads of a GQA group share one
  K/V read. Static shapes, so the decode step captures into a CUDA graph.
- `prefill` on CUDA: a Triton kernel (`paged_prefill.py`) attends each chunk of new tokens to its sequence's context
  straight from the cache, causally, one launch a layer (`engine_kwargs.native.prefill_kernel`, on by default).
- everything else (prefill and decode on CPU, or with `prefill_kernel=False`): gather each sequence's context
  from the cache into a padded [S, K] batch and call `scaled_dot_product_attention`. This path is simple enough to
  be the CPU reference.

The cache layout is [num_blocks, block_size, kv_heads, head_dim] per layer; a token's "slot" is
block_id * block_size + offset, so writing new K/V is one `index_copy_` per layer.

FP8 KV cache (`rollout.kv_cache_dtype=fp8`): e4m3 values with one fp32 scale per (token, kv head), a
[num_blocks, block_size, kv_heads] tensor beside each cache. Why that granularity:
- RL changes the weights every step, so a per-tensor or per-head scale would need re-calibration after every
  `update_weights` (vLLM's static k_scale/v_scale come from a calibration pass); a per-token scale is computed when the
  token is written and is never stale.
- Accuracy: with an outlier token 1000x larger (an attention sink), per-token scales give 1.9% relative error on
  the other tokens against 2.3% for one per-tensor scale (e4m3's exponent absorbs most of an outlier), and a static
  scale calibrated before an update that doubles K gives 4.7% (values past 448 saturate): measured in
  tests/test_fp8_rollout_on_cpu.py.
- It costs 4 bytes per 128-byte head row (3%), and the kernels fold it in for free: K's scale multiplies the score
  column (q.k_t * s_t), V's scale multiplies the probability column before the P.V product.
Writes quantise (amax over head_dim, /448, cast); reads upcast. On CPU the gather path does the same in torch, so the
option works (and is tested) everywhere. The CUDA decode kernel reads the e4m3 bytes directly; prefill gathers the
step's context (as in bf16) and upcasts that temporary.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import NamedTuple

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
    decode_kernel: str = "v1"  # which paged kernel (DECODE_KERNELS; chosen by `choose_decode_kernel`)
    use_kernel: bool = False
    # gather path inputs
    gather_slots: torch.Tensor | None = None  # [S, K] int64 cache slots of each sequence's context (padded)
    q_index: torch.Tensor | None = None  # [S, Q] index into the flat T queries, T (a zero row) for padding
    out_index: torch.Tensor | None = None  # [T] index of each flat query in the padded S*Q layout
    mask: torch.Tensor | None = None  # [S, 1, Q, K] bool (True = attend); None = plain causal, no cached prefix
    # paged prefill kernel inputs (prefill on CUDA, `paged_prefill.py`): [4, S] int64 block-table rows, first rows in
    # the flat T, first positions and lengths of each sequence's chunk; and the longest chunk
    prefill_rows: torch.Tensor | None = None
    max_q: int = 0


# paged-decode kernels by name, each a module with `paged_decode` and `choose_num_splits` (imported on first use: CUDA)
DECODE_KERNELS = {"v1": "polyrl.rollout.native.paged_decode", "v2": "polyrl.rollout.native.paged_decode_v2"}


DECODE_KERNEL_CHOICES = ("auto", *DECODE_KERNELS)
# v2 takes the qkv GEMM's output and does rope_kv's work itself (`paged_decode_v2.paged_decode_rope`, Qwen3's q/k norms
# included): one launch fewer a layer, s1 8,616 -> 8,768 and 8,649 -> 8,821 tok/s in two A/B calls (8,816 in a third
# run), (a) +1.2% / -0.6% (H100, FP8 KV + W8, 2026-11-26). False only in the test that compares it with rope_kv's own
# launch (tests/test_native_rollout_gpu.py), which v1, the CPU and prefill still use.
FUSED_ROPE = True
# CUDA prefill chunks attend through `paged_prefill.py` (one launch a layer, straight from the paged cache) instead of
# the gather path: (a)'s prefill 0.22 against 0.25 s of GPU time in FP8 KV + W8, 0.32 / 0.34 in bf16, s2's 0.43 /
# 0.47 (H100, A/B one process each, 2026-11-27). `engine_kwargs.native.prefill_kernel=False` keeps the gather path (a
# fallback from the Triton kernel; NativeEngine.prefill_kernel).


def decode_kernel_module(name: str):
    return importlib.import_module(DECODE_KERNELS[name])


def choose_decode_kernel(name: str, kv_fp8: bool, block_size: int) -> tuple[str, str]:
    """The paged-decode kernel for `engine_kwargs.native.decode_kernel=name`, and why (for the one log line).

    `auto` (the default) takes v2 wherever it runs (a power-of-two block size), v1 otherwise. H100 measurements:
    - e4m3 (2026-11-24, `benchmarks/probes/decode_kernel.py`, B = 64/128 x 16k context): v2 1.24-1.32x faster than v1 (v1
      gathers 8-bit V byte by byte); end to end 2.15x -> 2.21x the seed on s1 and 55.5k -> 63.4k tok/s on (a).
    - bf16 (2026-11-26, `decode_kernel.py --regimes bf16`, one layer): with CONFIG at rows 128 and two programs an SM,
      v2 ties v1 at shape (a) (72.7 against 72.6 us) and beats it in s1's bulk and tail (B = 64 x 16k 364 against
      377 us, 32 x 16k 187 / 210, 8 x 16k 54 / 68); end to end, one process each, s1 at 64 sequences 6,449
      against 5,669 tok/s and (a) 54,938 against 54,068 (v2 also does rope_kv's work, `FUSED_ROPE`)."""
    if name != "auto":
        return name, "set by actor_rollout_ref.rollout.engine_kwargs.native.decode_kernel"
    if block_size & (block_size - 1) == 0:
        return "v2", f"v2 is the faster paged-decode kernel for a {'FP8' if kv_fp8 else 'bf16'} cache (H100)"
    return "v1", "v2 needs a power-of-two block size"


@functools.cache
def sm_count(device: torch.device) -> int:
    """The GPU's SM count, which the decode kernels size their grids by; 8 off CUDA (Triton's CPU interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_fp8_rows(x_THD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and fp32 scales, one per row of the last dim: x ~= q * scale[..., None]."""
    x32 = x_THD.float()
    scale_TH = x32.abs().amax(-1).clamp(min=1e-8) / FP8_MAX
    return (x32 / scale_TH[..., None]).to(FP8), scale_TH


class FP8Rows(NamedTuple):
    """An activation already in `quantize_fp8_rows`' form, made by the kernel that produced it (fused.py's
    add_rmsnorm / silu_mul with fp8=True), for an FP8 GEMM that then skips its own quantisation launch."""

    q: torch.Tensor  # [T, K] e4m3
    scale: torch.Tensor  # [T] fp32; or [S, T], one per (K slice, row), for a split-K GEMM's S splits (fused.silu_mul)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def _write(cache, x_THD, slot_mapping_T, scale_cache) -> None:
    flat = cache.view(-1, *cache.shape[2:])
    if scale_cache is None:
        flat.index_copy_(0, slot_mapping_T, x_THD)
        return
    q, s = quantize_fp8_rows(x_THD)
    # index_copy_ has no float8 kernel on CPU; the bytes are the same through a uint8 view
    flat.view(torch.uint8).index_copy_(0, slot_mapping_T, q.view(torch.uint8))
    scale_cache.view(-1, scale_cache.shape[-1]).index_copy_(0, slot_mapping_T, s)


def write_kv(k_cache, v_cache, k_THD, v_THD, slot_mapping_T, k_scale=None, v_scale=None) -> None:
    """Write new K/V at their slots; with scale caches (FP8 KV) each (token, head) row is quantised on the way."""
    _write(k_cache, k_THD, slot_mapping_T, k_scale)
    _write(v_cache, v_THD, slot_mapping_T, v_scale)


def paged_attention(q_THD, k_cache, v_cache, meta: AttnMeta, scale: float, k_scale=None, v_scale=None):
    if meta.use_kernel:
        kernel = decode_kernel_module(meta.decode_kernel)
        return kernel.paged_decode(q_THD, k_cache, v_cache, meta, scale, k_scale, v_scale)
    if meta.prefill_rows is not None:
        from polyrl.rollout.native.paged_prefill import paged_prefill

        return paged_prefill(q_THD, k_cache, v_cache, meta, scale, k_scale, v_scale)
    return gather_attention(q_THD, k_cache, v_cache, meta, scale, k_scale, v_scale)


def _gather(cache, scale_cache, slots_SK, dtype) -> torch.Tensor:
    kvh, D = cache.shape[2:]
    x = cache.view(-1, kvh, D)[slots_SK]  # [S, K, kvh, D]
    if scale_cache is None:
        return x
    return (x.float() * scale_cache.view(-1, kvh)[slots_SK][..., None]).to(dtype)


def gather_attention(q_THD, k_cache, v_cache, meta: AttnMeta, scale: float, k_scale=None, v_scale=None):
    T, H, D = q_THD.shape
    kvh = k_cache.shape[2]
    S, Q = meta.q_index.shape
    q_pad = torch.cat([q_THD, q_THD.new_zeros(1, H, D)])[meta.q_index]  # [S, Q, H, D]
    k = _gather(k_cache, k_scale, meta.gather_slots, q_THD.dtype)
    v = _gather(v_cache, v_scale, meta.gather_slots, q_THD.dtype)
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
