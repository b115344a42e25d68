"""The fused kernels' FP8 output (add_rmsnorm / silu_mul with fp8=True: the next FP8 GEMM's input quantised in the
producer's own pass) under Triton's CPU interpreter: the same e4m3 bytes and scales as `quantize_fp8_rows` of the
unfused output, and an FP8 GEMM fed `FP8Rows` equal to the one that quantises for itself. fp32/fp16 activations (the
interpreter has no bf16 arithmetic of its own).

Skipped unless `triton` imports AND TRITON_INTERPRET=1 (CI has neither). Run it with
`TRITON_INTERPRET=1 PYTHONPATH=/work/triton_site:. python -m pytest -q tests/test_fused_fp8_input_interp_on_cpu.py`.
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("triton_interpreter_scalars")]


def _same_rows(got, x):
    """Same scales; the same e4m3 values but for the interpreter's own e4m3 cast (numpy emulation, not the GPU's
    cvt), which rounds some values to the neighbouring e4m3 value and drops the carry of a mantissa that rounds up to
    the next power of two (it writes -64 for -128). The GPU test compares the bytes (tests/test_fp8_rollout_gpu.py)."""
    from polyrl.rollout.native.attention import quantize_fp8_rows

    q, s = quantize_fp8_rows(x)
    assert got.q.dtype == torch.float8_e4m3fn and got.shape == x.shape
    assert torch.equal(got.scale, s)
    a, b = got.q.float(), q.float()
    off = a != b
    carry_bug = (a * 2 == b) & (torch.log2(b.abs()) % 1 == 0)
    step = torch.maximum(0.126 * torch.maximum(a.abs(), b.abs()), torch.tensor(2.0**-9))  # 3 mantissa bits; subnormals
    neighbour = (a - b).abs() <= step
    bad = off & ~carry_bug & ~neighbour
    assert not bad.any(), (a[bad], b[bad])
    assert off.float().mean() < 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
def test_add_rmsnorm_fp8_rows_are_the_quantised_norm(dtype, residual):
    from polyrl.rollout.native.fused import add_rmsnorm

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 96, generator=g) * 3).to(dtype)
    r = torch.randn(5, 96, generator=g).to(dtype) if residual else None
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    y, res = add_rmsnorm(x, r, w, 1e-6)
    rows, res8 = add_rmsnorm(x, r, w, 1e-6, fp8=True)
    assert torch.equal(res8, res)
    _same_rows(rows, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [64, 1500])  # one power of two, one not (a masked tail in the row's one block)
def test_silu_mul_fp8_rows_are_the_quantised_product(dtype, inter):
    from polyrl.rollout.native.fused import silu_mul

    gu = (torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    _same_rows(silu_mul(gu, fp8=True), silu_mul(gu))


@pytest.mark.parametrize("inter,slice_cols", [(1500, 500), (1500, 448), (96, 96)])  # even, ragged last, one slice
def test_silu_mul_fp8_slices_are_each_slice_quantised(inter, slice_cols):
    """slice_cols: one scale per (slice, row), [slices, T], each slice's e4m3 values those of quantize_fp8_rows over
    that slice alone."""
    from polyrl.rollout.native.attention import FP8Rows
    from polyrl.rollout.native.fused import silu_mul

    gu = torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(4)) * 2
    got, y = silu_mul(gu, fp8=True, slice_cols=slice_cols), silu_mul(gu)
    n = -(-inter // slice_cols)
    assert got.scale.shape == (n, 3)
    for j in range(n):
        cols = slice(j * slice_cols, min(inter, (j + 1) * slice_cols))
        _same_rows(FP8Rows(got.q[:, cols], got.scale[j]), y[:, cols])


def test_splitk_partials_take_one_scale_per_split_and_row():
    """The split-K kernel's partials with x scaled per (K split, row) (silu_mul's slices at the kernel's k_slices):
    they sum to the dequantised product; scales of another shape are refused."""
    from polyrl.rollout.native import splitk_fp8
    from polyrl.rollout.native.attention import FP8Rows, quantize_fp8_rows
    from polyrl.rollout.native.fused import silu_mul

    g = torch.Generator().manual_seed(5)
    M, K, N = 6, 288, 40
    config = dict(BN=16, BK=32, num_warps=4, num_stages=1, split=3)
    per = splitk_fp8.k_slices(M, N, K, config, num_sms=8)
    assert per == 96
    x = silu_mul(torch.randn(M, 2 * K, generator=g) * 2, fp8=True, slice_cols=per)
    w8, ws = quantize_fp8_rows(torch.randn(N, K, generator=g) * 0.05)
    parts = splitk_fp8.splitk_fp8_matmul(x, w8, ws, None, torch.float32, config, partials=True)
    x_used = x.q.double() * x.scale.double().t().repeat_interleave(per, dim=1)[:, :K]
    ref = x_used @ (w8.double() * ws.double()[:, None]).t()
    assert ((parts.double().sum(0) - ref).norm() / ref.norm()).item() < 1e-5
    with pytest.raises(ValueError, match="one per"):
        splitk_fp8.splitk_fp8_matmul(FP8Rows(x.q, x.scale[:2]), w8, ws, None, torch.float32, config, partials=True)
    with pytest.raises(ValueError, match="partials=True"):
        splitk_fp8.splitk_fp8_matmul(x, w8, ws, None, torch.float32, config)


def test_fp8_gemm_fed_rows_equals_the_one_that_quantises_itself():
    from polyrl.rollout.native.attention import FP8Rows, quantize_fp8_rows
    from polyrl.rollout.native.fp8_linear import fp8_matmul

    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 64, generator=g)
    w8, ws = quantize_fp8_rows(torch.randn(48, 64, generator=g) * 0.05)
    b = torch.randn(48, generator=g)
    assert torch.equal(fp8_matmul(FP8Rows(*quantize_fp8_rows(x)), w8, ws, b, torch.float32),
                       fp8_matmul(x, w8, ws, b, torch.float32))


def test_fused_engine_hands_fp8_rows_to_its_fp8_gemms(monkeypatch):
    """An FP8-weight engine (every GEMM FP8 on CPU) on the CUDA path's fused kernels, interpreted, 20 sequences (past
    w8a16's 16 rows in prefill and decode): with FUSED_INPUT the producers hand qkv, gate_up and down their input as
    `FP8Rows` (o's comes from attention, quantised by its GEMM), and the first token's log-probs stay within e4m3
    rounding of the GEMMs quantising for themselves (the interpreter's e4m3 cast is not torch's: not bitwise)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine, fp8_linear
    from polyrl.rollout.native.attention import FP8Rows

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)).eval()  # fmt: skip
    prompts = [torch.randint(0, 128, (3 + i % 4,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(20)]  # fmt: skip
    plain = fp8_linear.fp8_matmul
    out, fed = {}, {}
    for fused_input in (False, True):
        calls = []
        monkeypatch.setattr(fp8_linear, "FUSED_INPUT", fused_input)
        monkeypatch.setattr(fp8_linear, "fp8_matmul", lambda x, *a: calls.append(isinstance(x, FP8Rows)) or plain(x, *a))
        eng = NativeEngine.from_hf(hf, device="cpu", num_kv_tokens=1024, quantization="fp8", enforce_eager=True)
        eng.model.fused = True  # the CUDA path's kernels, interpreted
        out[fused_input] = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))
        fed[fused_input] = (sum(calls), len(calls))
    assert fed[False][0] == 0
    assert fed[True] == (3 * fed[True][1] // 4, fed[False][1])  # 3 of each layer's 4 GEMMs, every forward
    gaps = [abs(a[0] - b[0]) for a, b in zip(out[True].logprobs, out[False].logprobs)]
    assert max(gaps) < 0.05, gaps


@pytest.mark.parametrize("fp8", [False, True])
def test_add_rmsnorm_sums_split_k_partials_as_one_gemm_output(fp8):
    """x as [P, T, N] partials (`model.sliced_linear`): the same result as add_rmsnorm of their fp32 sum rounded once to
    the activation dtype, the residual output included."""
    from polyrl.rollout.native.fused import add_rmsnorm

    g = torch.Generator().manual_seed(4)
    parts = torch.randn(4, 5, 96, generator=g).to(torch.float16)
    r = torch.randn(5, 96, generator=g).to(torch.float16)
    w = (torch.rand(96, generator=g) + 0.5).to(torch.float16)
    y, res = add_rmsnorm(parts, r, w, 1e-6, fp8=fp8)
    y1, res1 = add_rmsnorm(parts.float().sum(0).to(torch.float16), r, w, 1e-6, fp8=fp8)
    assert torch.equal(res, res1)
    assert torch.equal(y.q, y1.q) and torch.equal(y.scale, y1.scale) if fp8 else torch.equal(y, y1)
    with pytest.raises(ValueError, match="residual"):
        add_rmsnorm(parts, None, w, 1e-6)
