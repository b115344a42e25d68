"""FP8 rollout on CUDA: the e4m3 paged-decode kernel against a dequantised reference, the fused FP8 K/V write
against the torch quantiser, the FP8 GEMM against its dequantised product, and the engine end to end.

Run on the GPU machine: `PYTHONPATH=. python -m pytest -q tests/test_fp8_rollout_gpu.py -s`.
"""

import gc

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_paged_decode_matches_dequantised_reference(dtype, splits):
    from paged_cases import decode_meta, dequantised, reference_decode, shuffled_block_table

    from polyrl.rollout.native.attention import quantize_fp8_rows
    from polyrl.rollout.native.paged_decode import paged_decode

    torch.manual_seed(0)
    NB, BS, KVH, D, H = 300, 16, 2, 128, 12
    k8, ks = quantize_fp8_rows(torch.randn(NB, BS, KVH, D, device="cuda") * 3)
    v8, vs = quantize_fp8_rows(torch.randn(NB, BS, KVH, D, device="cuda"))
    ctx = np.array([1, 17, 1000, 64, 0, 300, 129])
    slots = np.array([3, 0, 6, 2, 1, 8, 5])
    bt = shuffled_block_table(ctx, slots, rows=9, width=70, num_blocks=NB, block_size=BS)
    q = torch.randn(len(ctx), H, D, dtype=dtype, device="cuda")
    out = paged_decode(q, k8, v8, decode_meta(bt, slots, ctx, splits, "cuda"), D**-0.5, ks, vs).double()
    ref = reference_decode(q, dequantised(k8, ks), dequantised(v8, vs), bt, slots, ctx, BS)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i in range(len(ctx)):
        if ctx[i] == 0:
            assert out[i].abs().max() == 0
            continue
        assert ((out[i] - ref[i]).norm() / ref[i].norm()).item() < tol, (i, dtype, splits)


def test_fused_fp8_kv_write_matches_torch_quantiser():
    from polyrl.rollout.native.attention import quantize_fp8_rows
    from polyrl.rollout.native.fused import rope_kv

    torch.manual_seed(0)
    T, H, KVH, D, NB, BS = 37, 12, 2, 128, 8, 16
    qkv = torch.randn(T, (H + 2 * KVH) * D, dtype=torch.bfloat16, device="cuda")
    pos = torch.arange(T, device="cuda")
    cos = torch.ones(64, D, device="cuda")  # identity rotation: the cache must hold the quantised K and V
    sin = torch.zeros(64, D, device="cuda")
    kc = torch.zeros(NB, BS, KVH, D, dtype=torch.float8_e4m3fn, device="cuda")
    vc = torch.zeros_like(kc)
    ksc = torch.zeros(NB, BS, KVH, device="cuda")
    vsc = torch.zeros_like(ksc)
    slots = torch.randperm(NB * BS, device="cuda")[:T]
    rope_kv(qkv, pos, cos, sin, kc, vc, slots, H, KVH, D, k_scale=ksc, v_scale=vsc)
    k = qkv[:, H * D : (H + KVH) * D].view(T, KVH, D)
    v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
    for cache, scales, x in ((kc, ksc, k), (vc, vsc, v)):
        q_ref, s_ref = quantize_fp8_rows(x)
        got = cache.view(-1, KVH, D)[slots].float() * scales.view(-1, KVH)[slots][..., None]
        torch.testing.assert_close(scales.view(-1, KVH)[slots], s_ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(got, q_ref.float() * s_ref[..., None], rtol=0.07, atol=1e-6)


@pytest.mark.parametrize("M", [1, 8, 16, 17, 64, 256])
@pytest.mark.parametrize("K,N", [(1536, 2048), (8960, 1536), (1536, 17920)])  # 1.5B qkv, down, gate_up
def test_fp8_linear_matches_dequantised_product(M, K, N):
    """<= 16 rows: the W8A16 kernel (x unquantised); more: W8A8 `_scaled_mm` (x quantised per token)."""
    from polyrl.rollout.native.attention import quantize_fp8_rows
    from polyrl.rollout.native.fp8_linear import W8A16_MAX_ROWS, FP8Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=True, dtype=torch.bfloat16, device="cuda")
    f8 = FP8Linear(lin)
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    if M <= W8A16_MAX_ROWS:
        x_used = x.double()
    else:
        xq, xs = quantize_fp8_rows(x)
        x_used = xq.double() * xs.double()[:, None]
    ref = x_used @ (f8.weight.double() * f8.weight_scale.double()[:, None]).t() + lin.bias.double()
    out = f8(x).double()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2
    exact = x.double() @ lin.weight.double().t() + lin.bias.double()
    assert ((out - exact).norm() / exact.norm()).item() < 0.06  # e4m3 rounding of the weight (and x past 16 rows)


@pytest.mark.parametrize("M", [17, 32, 33, 64])
def test_w8a16_kernel_serves_up_to_64_rows_in_bf16(M):
    """The kernel's 32- and 64-row tiles (not routed to by FP8Linear until they win on time) on real bf16 dots."""
    from polyrl.rollout.native.attention import quantize_fp8_rows
    from polyrl.rollout.native.w8a16 import w8a16_matmul

    torch.manual_seed(M)
    w8, s = quantize_fp8_rows(torch.randn(17920, 1536, device="cuda") * 0.05)
    x = torch.randn(M, 1536, dtype=torch.bfloat16, device="cuda")
    ref = x.double() @ (w8.double() * s.double()[:, None]).t()
    out = w8a16_matmul(x, w8, s, None, torch.bfloat16).double()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("M", [1, 16, 33, 64, 128, 200, 256])
@pytest.mark.parametrize("K,N", [(1536, 2048), (8960, 1536), (1536, 17920), (1536, 1536)])  # qkv, down, gate_up, o
def test_splitk_kernel_matches_the_dequantised_product_and_repeats_bitwise(M, K, N):
    """splitk_fp8.py on the GPU: e4m3 rows and weights (the FP8 MMA), K split so the GEMM covers the SMs, partials
    reduced in the launch, more than 64 rows in row blocks; the same bits on every call, in a CUDA graph replayed
    too."""
    from polyrl.rollout.native import splitk_fp8
    from polyrl.rollout.native.attention import FP8Rows, quantize_fp8_rows

    torch.manual_seed(M + N)
    w8, s = quantize_fp8_rows(torch.randn(N, K, device="cuda") * 0.05)
    bias = torch.randn(N, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    xq, xs = quantize_fp8_rows(x)
    arg, x_used = FP8Rows(xq, xs), xq.double() * xs.double()[:, None]
    ref = x_used @ (w8.double() * s.double()[:, None]).t() + bias.double()
    out = splitk_fp8.splitk_fp8_matmul(arg, w8, s, bias, torch.bfloat16)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    split = splitk_fp8.plan(M, N, K, splitk_fp8.CONFIG, sms)[1]
    runs = [splitk_fp8.splitk_fp8_matmul(arg, w8, s, bias, torch.bfloat16) for _ in range(20)]
    assert all(torch.equal(r, out) for r in runs), f"split {split}: not the same bits on every call"
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = splitk_fp8.splitk_fp8_matmul(arg, w8, s, bias, torch.bfloat16)
    for _ in range(5):
        y.zero_()
        g.replay()
        assert torch.equal(y, out), f"split {split}: a graph replay differs"


@pytest.mark.parametrize("M", [129, 200, 256])
@pytest.mark.parametrize("N", [17920, 16896])  # the 1.5B gate_up (a leftover chunk a program for 64), none left over
def test_one_wave_kernel_matches_the_dequantised_product(M, N):
    """wave_fp8.py on the GPU (the e4m3 MMA, 256-row tiles, one program per SM with a leftover chunk): the dequantised
    product, the same bits in a CUDA graph replay, and the engine's dispatch (`fp8_matmul`) takes it for gate_up."""
    from polyrl.rollout.native import wave_fp8
    from polyrl.rollout.native.attention import FP8Rows, quantize_fp8_rows
    from polyrl.rollout.native.fp8_linear import fp8_matmul

    torch.manual_seed(M + N)
    w8, s = quantize_fp8_rows(torch.randn(N, 1536, device="cuda") * 0.05)
    xq, xs = quantize_fp8_rows(torch.randn(M, 1536, dtype=torch.bfloat16, device="cuda"))
    arg = FP8Rows(xq, xs)
    ref = (xq.double() * xs.double()[:, None]) @ (w8.double() * s.double()[:, None]).t()
    out = wave_fp8.one_wave_fp8_matmul(arg, w8, s, torch.bfloat16)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = wave_fp8.one_wave_fp8_matmul(arg, w8, s, torch.bfloat16)
    y.zero_()
    g.replay()
    assert torch.equal(y, out)
    if N == 17920:
        assert wave_fp8.serves(M, N, 1536, xq.device)
        assert torch.equal(fp8_matmul(arg, w8, s, None, torch.bfloat16), out)


@pytest.mark.parametrize("M", [64, 128, 256])
@pytest.mark.parametrize("config", [dict(BM=256, BN=64, BK=128, num_warps=4, num_stages=4, split=6),
                                    dict(BM=128, BN=128, BK=256, num_warps=8, num_stages=3, split=4)])
def test_splitk_partials_with_whole_row_tiles_sum_to_the_product(M, config):
    """splitk_fp8.py's `partials=True` on the GPU (the e4m3 MMA with tiles of 128-256 rows): the [split, M, N]
    partials sum to the dequantised product of the 1.5B down projection's shape."""
    from polyrl.rollout.native import splitk_fp8
    from polyrl.rollout.native.attention import FP8Rows, quantize_fp8_rows

    torch.manual_seed(M)
    w8, s = quantize_fp8_rows(torch.randn(1536, 8960, device="cuda") * 0.05)
    xq, xs = quantize_fp8_rows(torch.randn(M, 8960, dtype=torch.bfloat16, device="cuda"))
    ref = (xq.double() * xs.double()[:, None]) @ (w8.double() * s.double()[:, None]).t()
    c = {**splitk_fp8.CONFIG, **config}
    parts = splitk_fp8.splitk_fp8_matmul(FP8Rows(xq, xs), w8, s, None, torch.bfloat16, c, partials=True)
    assert parts.shape == (config["split"], M, 1536)
    assert ((parts.double().sum(0) - ref).norm() / ref.norm()).item() < 1e-2


def test_fp8_down_partials_keep_logprobs_as_close_to_hf(monkeypatch):
    """A model with the 1.5B MLP shape in FP8 KV + FP8 weights: the down projection's split-K partials summed by
    add_rmsnorm (`fp8_linear.PARTIALS`, 64 rows here) give log-probs as close to HF's recomputation as the in-launch
    reduction."""
    from logprob_gap import hf_logprob_gap, mlp15b_model

    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine, fp8_linear, model

    m = mlp15b_model()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in torch.randint(5, 100, (64,), generator=g)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5)
    gaps = {}
    for on in (True, False):
        monkeypatch.setattr(fp8_linear, "PARTIALS", dict(fp8_linear.PARTIALS) if on else {})
        eng = NativeEngine.from_hf(m, num_kv_tokens=1 << 14, kv_cache_dtype="fp8", quantization="fp8")
        assert (model.down_partials(eng.model.layers[0].mlp.down, 64)[0] is not None) == on
        gaps[on] = hf_logprob_gap(m, prompts, eng.generate(prompts, sp))
    print(f"1.5B-MLP FP8 logprob gap to HF: partials {gaps[True]:.2e}, reduced in the launch {gaps[False]:.2e}")
    assert gaps[True] <= 1.25 * gaps[False] + 1e-3, gaps


def test_engine_fp8_holds_about_twice_the_tokens_and_decodes_close_to_bf16():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    m = Qwen2ForCausalLM(cfg).to(torch.bfloat16).cuda().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 2:
                p.mul_(3.0)  # peaked distributions, like a trained model's
    prompts = torch.randint(0, 4096, (32, 40), generator=torch.Generator().manual_seed(0)).tolist()
    sp = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    bf16 = NativeEngine.from_hf(m, gpu_memory_utilization=0.3, max_model_len=2048)
    ref = bf16.generate(prompts, sp)
    n_bf16 = bf16.num_blocks
    del bf16
    gc.collect()  # an engine lives in reference cycles: free its cache before the next one sizes its own
    torch.cuda.empty_cache()
    for kw in (dict(kv_cache_dtype="fp8"), dict(kv_cache_dtype="fp8", quantization="fp8")):
        eng = NativeEngine.from_hf(m, gpu_memory_utilization=0.3, max_model_len=2048, **kw)
        out = eng.generate(prompts, sp)
        first = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r))
                 for r, o in zip(ref.token_ids, out.token_ids)]
        gaps = [abs(a - b) for r, o, i in zip(ref.logprobs, out.logprobs, first) for a, b in zip(r[:i], o[:i])]
        print(f"{kw}: blocks {eng.num_blocks} vs bf16 {n_bf16} ({eng.num_blocks / n_bf16:.2f}x); tokens before the "
              f"first flip {np.mean(first):.1f}/32; logprob gap mean {np.mean(gaps):.4f}")
        assert eng.num_blocks > 1.8 * n_bf16
        assert np.mean(gaps) < 0.2  # 0.107 measured with FP8 KV on an H100 (3x-scaled weights: peaked logits)
        del eng
        gc.collect()
        torch.cuda.empty_cache()


def test_weight_quantiser_matches_the_tensor_op_one():
    """The one-launch weight quantiser (made at every weight update) against `quantize_fp8_rows`: scales to fp32
    rounding, values equal but for rare e4m3 rounding ties (Triton's division is within 2 ulp, not IEEE)."""
    from polyrl.rollout.native.attention import quantize_fp8_rows
    from polyrl.rollout.native.fp8_linear import quantize_weight_rows

    torch.manual_seed(0)
    for K in (3072, 12288, 1000):  # Qwen-Image's attention and MLP-down widths, and one that is not a power of 2
        w = torch.randn(512, K, dtype=torch.bfloat16, device="cuda") * torch.rand(512, 1, device="cuda").bfloat16()
        q, s = quantize_weight_rows(w)
        q_ref, s_ref = quantize_fp8_rows(w)
        torch.testing.assert_close(s, s_ref, rtol=2e-7, atol=0)
        same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
        assert same > 0.999, (K, same)
        torch.testing.assert_close(q.float() * s[:, None], q_ref.float() * s_ref[:, None], rtol=0.07, atol=1e-6)


def test_fused_producers_quantise_like_the_torch_quantiser():
    """add_rmsnorm / silu_mul with fp8=True (the next FP8 GEMM's input quantised in the producer's pass; the
    default; fp8_linear.FUSED_INPUT) against `quantize_fp8_rows` of their bf16 output, and the GEMM fed
    those rows against the one that quantises for itself."""
    from polyrl.rollout.native.attention import quantize_fp8_rows
    from polyrl.rollout.native.fp8_linear import fp8_matmul
    from polyrl.rollout.native.fused import add_rmsnorm, silu_mul

    torch.manual_seed(0)
    x = torch.randn(64, 1536, dtype=torch.bfloat16, device="cuda") * 3
    r = torch.randn_like(x)
    w = torch.rand(1536, device="cuda").bfloat16() + 0.5
    gu = torch.randn(64, 2 * 8960, dtype=torch.bfloat16, device="cuda") * 2
    for rows, plain in ((add_rmsnorm(x, r, w, 1e-6, fp8=True)[0], add_rmsnorm(x, r, w, 1e-6)[0]),
                        (silu_mul(gu, fp8=True), silu_mul(gu))):
        q_ref, s_ref = quantize_fp8_rows(plain)
        torch.testing.assert_close(rows.scale, s_ref, rtol=2e-7, atol=0)
        assert (rows.q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item() > 0.999
    sliced, plain = silu_mul(gu, fp8=True, slice_cols=2304), silu_mul(gu)  # one scale per (down's K split, row)
    for j in range(4):
        cols = slice(2304 * j, min(8960, 2304 * (j + 1)))
        q_ref, s_ref = quantize_fp8_rows(plain[:, cols].contiguous())
        torch.testing.assert_close(sliced.scale[j], s_ref, rtol=2e-7, atol=0)
        assert (sliced.q[:, cols].view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item() > 0.999
    w8, ws = quantize_fp8_rows(torch.randn(2048, 1536, device="cuda").bfloat16() * 0.05)
    rows = add_rmsnorm(x, r, w, 1e-6, fp8=True)[0]
    h = add_rmsnorm(x, r, w, 1e-6)[0]
    torch.testing.assert_close(fp8_matmul(rows, w8, ws, None, torch.bfloat16), fp8_matmul(h, w8, ws, None, torch.bfloat16),
                               rtol=0.02, atol=0.02)


def test_kernel_fallbacks_decode_like_the_default():
    """`engine_kwargs.native.prefill_kernel=False` (the gather path) and `fp8_splitk=False` (cuBLAS `_scaled_mm` and
    w8a16 instead of splitk_fp8.py), the fallbacks docs/switches.md offers, generate with log-probs as close to HF's
    recomputation as the default kernels, on the 1.5B-MLP test model in FP8 KV + FP8 weights."""
    from logprob_gap import hf_logprob_gap, mlp15b_model

    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine
    from polyrl.rollout.native.fp8_linear import FP8Linear

    m = mlp15b_model()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 100, (64,), generator=g)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, seed=7)
    gaps = {}
    settings = {"default": {}, "gather prefill": dict(prefill_kernel=False), "no split-K": dict(fp8_splitk=False)}
    for name, kw in settings.items():
        eng = NativeEngine.from_hf(m, num_kv_tokens=1 << 14, kv_cache_dtype="fp8", quantization="fp8", **kw)
        assert eng.prefill_kernel == kw.get("prefill_kernel", True)
        assert all(x.splitk == kw.get("fp8_splitk", True) for x in eng.model.modules() if isinstance(x, FP8Linear))
        gaps[name] = hf_logprob_gap(m, prompts, eng.generate(prompts, sp))
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    print("FP8 logprob gap to HF by kernel setting:", {k: f"{v:.2e}" for k, v in gaps.items()})
    for name in ("gather prefill", "no split-K"):
        assert gaps[name] <= 1.25 * gaps["default"] + 1e-3, gaps
