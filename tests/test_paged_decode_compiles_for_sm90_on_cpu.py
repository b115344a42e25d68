"""The paged-decode kernels compile for sm_90 (Hopper) with no GPU, through the triton wheel's own ptxas, and their
split count is a run-time argument that Triton does not specialise (one compile serves every batch size; as a
constexpr each new split count compiled the kernels again inside the rollout). Skipped where triton is not installed
(CI); run it with
`PYTHONPATH=<a triton 3.5 site> python -m pytest -q tests/test_paged_decode_compiles_for_sm90_on_cpu.py`.
"""

import os

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="the interpreter replaces the kernels: nothing to compile")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

from polyrl.rollout.native import paged_decode as v1  # noqa: E402
from polyrl.rollout.native import paged_decode_v2 as v2  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


def _decode_types(out_dtype: str, kv_dtype: str) -> dict:
    ptrs = dict(Q="*bf16", K=f"*{kv_dtype}", V=f"*{kv_dtype}", KS="*fp32", VS="*fp32", SeqSlots="*i64", BT="*i32",
                CL="*i32", O=f"*{out_dtype}", LSE=f"*{out_dtype}", scale="fp32")
    ints = {k: "i32" for k in ("stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_bt",
                               "stride_ot", "stride_oh", "stride_os", "SPLITS")}
    return {**ptrs, **ints}


@pytest.mark.parametrize("multi,fp8", [(False, False), (True, False), (True, True)])
def test_decode_kernels_compile_with_run_time_splits(multi, fp8):
    types = _decode_types("fp32" if multi else "bf16", "fp8e4nv" if fp8 else "bf16")
    common = dict(G=3, D=64, BS=16, MULTI=multi, IEEE=False, FP8=fp8, KVH=3)
    one = dict(GP=16, TILE=128 if fp8 else 64, **common)
    two = dict(HB=1, R=16, PAGES=8 if fp8 else 4, **common)
    rope = dict(POS="*i64", COS="*fp32", SIN="*fp32", SLOT="*i64", QW="*bf16", KW="*bf16", eps="fp32")
    for fn, consts, extra in ((v1._paged_decode_kernel, one, {}),
                              (v2._paged_decode_v2_kernel, dict(two, ROPE=False, HAS_NORM=False, PTX=True), rope),
                              (v2._paged_decode_v2_kernel, dict(two, ROPE=True, HAS_NORM=multi, PTX=True), rope)):
        sig = {**types, **extra, **{k: "constexpr" for k in consts}}
        ptx = compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=SM90).asm["ptx"]
        assert ("mul.rn.f32" in ptx) == consts.get("ROPE", False)  # RoPE's products rounded on their own


def test_rope_products_are_not_fused_into_bf16_fmas():
    """rope_kv rounds each RoPE product to bf16 before the add, as HF does: no `fma.rn.bf16` (which rounds a * b + c
    once, one ulp off in ~10% of values, H100 2026-11-26) and an opaque `mul.rn.f32` per product."""
    from polyrl.rollout.native import fused

    sig = dict(QKV="*bf16", POS="*i64", COS="*fp32", SIN="*fp32", SLOT="*i64", QO="*bf16", KC="*bf16", VC="*bf16",
               KS="*bf16", VS="*bf16", QW="*bf16", KW="*bf16", eps="fp32")
    consts = dict(H=12, KVH=2, HP=16, KVHP=2, D=128, HAS_NORM=False, FP8=False, PTX=True)
    sig.update({k: "constexpr" for k in consts})
    ptx = compile(ASTSource(fn=fused._rope_kv_kernel, signature=sig, constexprs=consts), target=SM90).asm["ptx"]
    assert "fma.rn.bf16" not in ptx and "mul.rn.f32" in ptx


def test_combine_compiles_and_no_kernel_specialises_on_splits():
    sig = dict(O="*fp32", LSE="*fp32", OUT="*bf16", SPLITS="i32", SP="constexpr", D="constexpr", CHUNK="constexpr")
    for chunk, warps in ((16, 4), (128, 8)):  # the bulk's chunk, and the long tail's (`combine_chunk`)
        consts = dict(SP=triton.next_power_of_2(v1.MAX_SPLITS), D=128, CHUNK=chunk)
        assert compile(ASTSource(fn=v1._combine_kernel, signature=sig, constexprs=consts), target=SM90,
                       options=dict(num_warps=warps)).asm["ptx"]
    assert [v1.combine_chunk(n) for n in (2, 16, 17, 30, 119, 238)] == [16, 16, 32, 32, 128, 128]
    for fn in (v1._paged_decode_kernel, v1._combine_kernel, v2._paged_decode_v2_kernel):
        splits = next(p for p in fn.params if p.name == "SPLITS")
        assert splits.do_not_specialize and not splits.is_constexpr, fn


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_producers_compile_with_and_without_fp8_output(fp8):
    """add_rmsnorm / silu_mul, their bf16 output or (fp8) e4m3 rows and scales for the next FP8 GEMM."""
    from polyrl.rollout.native import fused

    out = "*fp8e4nv" if fp8 else "*bf16"
    norm = dict(X="*bf16", R="*bf16", W="*bf16", Y=out, RO="*bf16", S="*fp32" if fp8 else out, eps="fp32", T="i32")
    for parts in (1, 4):  # 4: the sliced down projection's partial outputs summed first
        consts = dict(N=1536, BLOCK=2048, HAS_RES=True, FP8=fp8, PARTS=parts)
        sig = {**norm, **{k: "constexpr" for k in consts}}
        assert compile(ASTSource(fn=fused._add_rmsnorm_kernel, signature=sig, constexprs=consts),
                       target=SM90).asm["ptx"]
    # fp8: one scale per row (a program per row), or per (K slice of the down GEMM, row) at 2,304-column slices
    for slice_cols in ((8960, 2304) if fp8 else (1024,)):
        consts = dict(I=8960, SLICE=slice_cols, BLOCK=triton.next_power_of_2(slice_cols), FP8=fp8)
        sig = dict(GU="*bf16", Y=out, S="*fp32" if fp8 else out, T="i32", **{k: "constexpr" for k in consts})
        assert compile(ASTSource(fn=fused._silu_mul_kernel, signature=sig, constexprs=consts), target=SM90).asm["ptx"]


@pytest.mark.parametrize("split,partials,xs_per_split", [(1, False, False), (10, False, False), (10, True, False),
                                                          (4, True, True)])
def test_splitk_gemm_compiles_with_the_e4m3_mma_and_its_reduction(split, partials, xs_per_split):
    """splitk_fp8.py for sm_90, with and without the split reduction: the FP8 tensor-core instruction (wgmma ...
    e4m3), not an upcast, and the counter's atomic only when K is split and the partials are reduced in the launch
    (not when they go to the consumer)."""
    from polyrl.rollout.native import splitk_fp8

    sig = dict(X="*fp8e4nv", XS="*fp32", W="*fp8e4nv", WS="*fp32", B="*fp32", Y="*bf16",
               P="*fp32", C="*i32", M="i32", N="i32", K="i32", stride_xm="i32", stride_wn="i32", stride_ym="i32",
               k_per_split="i32", split="i32")
    consts = dict(BM=64, BN=64, BK=128, SPLIT_K=split > 1 and not partials, EVEN=True, DOT_FP8=True, HAS_BIAS=False,
                  PARTIALS=partials, XS_PER_SPLIT=xs_per_split)
    sig.update({k: "constexpr" for k in consts})
    ptx = compile(ASTSource(fn=splitk_fp8._splitk_kernel, signature=sig, constexprs=consts), target=SM90,
                  options=dict(num_warps=4, num_stages=4)).asm["ptx"]
    assert "e4m3" in ptx and "wgmma" in ptx
    assert ("atom" in ptx) == (split > 1 and not partials)


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_kernel_compiles(fp8):
    """paged_prefill.py's kernel for a bf16 and an e4m3 cache, at its launch (Qwen-1.5B heads, head_dim 128), down
    to sm_90 machine code; the e4m3 one upcasts its K/V bytes in registers (`cvt` from e4m3)."""
    from polyrl.rollout.native import paged_prefill as pp

    kv = "fp8e4nv" if fp8 else "bf16"
    sig = dict(Q="*bf16", K=f"*{kv}", V=f"*{kv}", KS="*fp32", VS="*fp32", BT="*i32", Rows="*i64", O="*bf16",
               scale="fp32", S="i32", **{k: "i32" for k in ("stride_qt", "stride_qh", "stride_kb", "stride_kt",
                                                             "stride_kh", "stride_bt", "stride_ot", "stride_oh")})
    consts = dict(G=6, KVH=2, D=128, BS=16, BQ=pp.BQ, BK=pp.BK, FP8=fp8, IEEE=False)
    sig.update({k: "constexpr" for k in consts})
    k = compile(ASTSource(fn=pp._paged_prefill_kernel, signature=sig, constexprs=consts), target=SM90,
                options=dict(num_warps=pp.NUM_WARPS, num_stages=pp.NUM_STAGES))
    assert k.asm["cubin"] and ("e4m3" in k.asm["ptx"]) == fp8
