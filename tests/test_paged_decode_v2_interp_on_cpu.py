"""The v2 paged-decode kernel (`paged_decode_v2.py`) under Triton's CPU interpreter, against a torch reference
that attends over the dequantised K/V: fp32, fp16 and e4m3 caches (e4m3 with bf16 queries, the engine's case), 1 and
3 splits, GQA groups that give one, two and four kv heads per program, ragged context lengths including 0 and partial
pages, block tables out of order.

Skipped unless `triton` imports AND TRITON_INTERPRET=1 (CI has neither, so it skips there). Run it with
`TRITON_INTERPRET=1 PYTHONPATH=/work/triton_site:. python -m pytest -q tests/test_paged_decode_v2_interp_on_cpu.py`.
The shapes are tiny because interpreted kernels are slow. A bf16 cache is not tested here: the interpreter's bf16
`tl.dot` multiplies raw bits (v1 gives garbage too); fp16 takes the same non-IEEE code path, and
tests/test_paged_decode_v2_gpu.py covers bf16 on CUDA.
"""

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

BS, D = 16, 32


pytestmark = [pytestmark, pytest.mark.usefixtures("triton_interpreter_scalars")]


def _cache(ctx, num_kv_heads, fp8, seed=0):
    """Random K/V pages for sequences of `ctx` tokens, their block-table rows (shuffled pages, rows not in sequence
    order) and, with fp8, e4m3 caches plus their per-(token, head) scales."""
    from paged_cases import decode_meta, shuffled_block_table

    from polyrl.rollout.native.attention import quantize_fp8_rows

    gen = torch.Generator().manual_seed(seed)
    need = [-(-c // BS) for c in ctx]
    nb = sum(need) + 2  # block 0 stays free (the engine's scratch block) and one spare
    k = torch.randn(nb, BS, num_kv_heads, D, generator=gen) * 2
    v = torch.randn(nb, BS, num_kv_heads, D, generator=gen)
    rows = len(ctx) + 2
    seq_slots = np.random.default_rng(seed).permutation(rows)[: len(ctx)]
    bt = shuffled_block_table(ctx, seq_slots, rows, max(need) + 1, nb, BS, seed=seed + 1, dtype=np.int32)
    scales = None
    if fp8:
        k, ks = quantize_fp8_rows(k)
        v, vs = quantize_fp8_rows(v)
        scales = (ks, vs)

    def meta(splits):
        return decode_meta(bt, seq_slots, np.array(ctx, dtype=np.int32), splits)

    return k, v, scales, bt, seq_slots, meta


def _reference(q, k, v, scales, bt, seq_slots, ctx):
    """Attention of each sequence's query over its dequantised context, in float64; zeros for an empty context."""
    from paged_cases import dequantised, reference_decode

    ks, vs = scales or (None, None)
    return reference_decode(q, dequantised(k, ks), dequantised(v, vs), bt, seq_slots, ctx, BS)


CTX = [37, 0, 300, 64]  # a partial page, an empty row (CUDA-graph padding), a long one, one of whole steps only


@pytest.mark.parametrize("kv", ["fp32", "fp16", "fp8"])
@pytest.mark.parametrize("splits", [1, 3, 40])  # 40: the combine loops over chunks; most splits are empty
@pytest.mark.parametrize("heads", [(4, 2), (12, 2), (8, 8)])  # kv heads per program: 2 (all), 1 (G=6 pads), 4
def test_v2_matches_dequantised_reference(kv, splits, heads):
    from polyrl.rollout.native import paged_decode_v2 as v2

    H, KVH = heads
    fp8 = kv == "fp8"
    k, v, scales, bt, seq_slots, meta = _cache(CTX, KVH, fp8)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "fp8": torch.bfloat16}[kv]
    if kv == "fp16":
        k, v = k.to(dtype), v.to(dtype)
    q = torch.randn(len(CTX), H, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = v2.paged_decode(q, k, v, meta(splits), D**-0.5, *(scales or (None, None)))
    assert out.shape == q.shape and out.dtype == dtype
    ref = _reference(q, k, v, scales, bt, seq_slots, CTX)
    tol = 1e-5 if kv == "fp32" else 2e-2
    for i, n in enumerate(CTX):
        if n == 0:
            assert out[i].abs().max() == 0
            continue
        err = ((out[i].double() - ref[i]).norm() / ref[i].norm()).item()
        assert err < tol, (i, kv, splits, heads, err)


@pytest.mark.parametrize("kv", ["fp32", "fp16", "fp8"])
@pytest.mark.parametrize("splits", [1, 3])
def test_v2_ignores_the_cache_past_each_context(kv, splits):
    """What the cache holds past a context (the rest of a partial last page, block 0 where a step runs past the last
    page) must not reach the output: fill those slots and block 0 with large finite values (for e4m3, large scales)
    and the result is still the reference's. (Written for a variant that read those slots unmasked, 2026-11-27.)"""
    from polyrl.rollout.native import paged_decode_v2 as v2

    fp8 = kv == "fp8"
    k, v, scales, bt, seq_slots, meta = _cache(CTX, 2, fp8, seed=4)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "fp8": torch.bfloat16}[kv]
    if kv == "fp16":
        k, v = k.to(dtype), v.to(dtype)
    junk = torch.zeros(k.shape[:2], dtype=torch.bool)  # [blocks, block_size]: slots no context covers
    junk[0] = True
    for i, n in enumerate(CTX):
        pages = bt[seq_slots[i], : -(-n // BS)]
        if n % BS:
            junk[pages[-1], n % BS :] = True
    for t in (scales if fp8 else (k, v)):
        t[junk] = 3e4
    q = torch.randn(len(CTX), 12, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = v2.paged_decode(q, k, v, meta(splits), D**-0.5, *(scales or (None, None)))
    ref = _reference(q, k, v, scales, bt, seq_slots, CTX)
    for i, n in enumerate(CTX):
        if n:
            err = ((out[i].double() - ref[i]).norm() / ref[i].norm()).item()
            assert err < (1e-5 if kv == "fp32" else 2e-2), (i, kv, splits, err)


def test_heads_per_program_fills_sixteen_rows():
    from polyrl.rollout.native.paged_decode_v2 import heads_per_program

    assert heads_per_program(12, 2) == 2  # Qwen-1.5B: both kv heads, 12 of 16 rows
    assert heads_per_program(32, 8) == 4  # Llama-8B: 4 x 4 = 16 rows
    assert heads_per_program(28, 4) == 2  # Qwen-7B: 2 x 7 = 14 rows
    assert heads_per_program(64, 2) == 1  # a group of 32 is its own program


def test_v2_agrees_with_v1_under_the_interpreter():
    """Both kernels on the same e4m3 cache and metadata: the two designs agree to float rounding."""
    from polyrl.rollout.native import paged_decode as v1
    from polyrl.rollout.native import paged_decode_v2 as v2

    k, v, scales, *_, meta = _cache([50, 129], 2, fp8=True, seed=3)
    q = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(2))
    a = v1.paged_decode(q, k, v, meta(2), D**-0.5, *scales)
    b = v2.paged_decode(q, k, v, meta(2), D**-0.5, *scales)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_v2_splits_fill_whole_waves():
    """132 SMs (an H100): the fewest splits whose programs fill the last wave to 90%; v2's fewer programs per
    sequence (one head block for Qwen-1.5B) need more splits than v1 at the same batch, and the long tail's batch 1
    gets a GPU's worth (not 16 programs, the old cap)."""
    from polyrl.rollout.native import paged_decode_v2 as v2

    slots = v2.CONFIG["programs_per_sm"] * 132
    for batch, heads, kv_heads in ((64, 12, 2), (128, 12, 2), (64, 32, 8), (8, 12, 2), (1, 12, 2)):
        n = v2.choose_num_splits(batch, kv_heads, 132, num_heads=heads)
        programs = batch * kv_heads // v2.heads_per_program(heads, kv_heads) * n
        waves = -(-programs // slots)
        assert 1 <= n <= v2.MAX_SPLITS
        assert programs / (waves * slots) >= 0.9 or n == v2.MAX_SPLITS, (batch, heads, n)
        assert n == 1 or (programs // n) / slots < 0.9  # one split would not do
    assert v2.choose_num_splits(1, 2, 132, num_heads=12) * 2 > 0.9 * 132


def test_fp8_launch_by_batch(monkeypatch):
    """132 SMs: an e4m3 cache takes one-warp programs (CONFIG_FP8_FEW) where the four-warp launch would need splits
    and the one-warp one needs at most FEW_MAX_SPLITS (s1's bulk, 32-128 Qwen sequences); the four-warp launch where
    it fills the GPU unsplit (shape (a)'s 256 rows) or where the one-warp one would need more splits (the last few
    rows). The split count follows the chosen launch's programs per SM, so the engine's split choice and the launch
    agree. FEW_WARPS False keeps the four-warp launch everywhere."""
    from polyrl.rollout.native import paged_decode_v2 as v2

    few, four = v2.CONFIG_FP8_FEW, v2.CONFIG_FP8
    cases = [(256, 12, 2, four, 1), (128, 12, 2, few, 8), (64, 12, 2, few, 15), (32, 12, 2, few, 30),
             (16, 12, 2, four, 15), (1, 12, 2, four, 238), (128, 32, 8, four, 1), (32, 32, 8, few, 15),
             (8, 32, 8, four, 15)]
    for batch, heads, kv_heads, config, splits in cases:
        blocks = kv_heads // v2.heads_per_program(heads, kv_heads)
        assert v2.fp8_config(batch, blocks, 132) is config, (batch, heads, kv_heads)
        assert v2.choose_num_splits(batch, kv_heads, 132, True, heads) == splits, (batch, heads, kv_heads)
    monkeypatch.setattr(v2, "FEW_WARPS", False)
    assert v2.fp8_config(64, 1, 132) is four
    assert v2.choose_num_splits(64, 2, 132, True, 12) == 4


def test_fused_kv_writer_and_torch_path_agree_on_the_fp8_cache_layout():
    """An FP8-KV engine on the CUDA path's fused kernels (rope_kv quantises and writes K and V), interpreted, against
    the torch path (write_kv / gather): the same cache contents up to the interpreter's e4m3 cast (it rounds some values
    to a neighbour and drops some carries: `_same_rows` in test_fused_fp8_input_interp_on_cpu.py), and the same first
    tokens. Two new tokens: the prompts are written by prefill and the first sampled token by a decode step, whose
    attention reads the cache through the torch gather, so a writer and a reader that disagreed on the cache layout
    would move most values (checked: a V writer left token-major under a page-transposed reader failed here)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)).eval()  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (5 + 7 * i,), generator=gen).tolist() for i in range(3)]  # 3 crosses a page
    caches, out = {}, {}
    for fused in (False, True):
        eng = NativeEngine.from_hf(hf, device="cpu", num_kv_tokens=256, kv_cache_dtype="fp8", enforce_eager=True)
        eng.model.fused = fused
        out[fused] = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))
        caches[fused] = (eng.kv.float(), eng.kv_scale.clone())
    assert [t[0] for t in out[True].token_ids] == [t[0] for t in out[False].token_ids]
    for j in (0, 1):  # K, V
        (a, sa), (b, sb) = ((c[0][:, j], c[1][:, j]) for c in (caches[True], caches[False]))
        assert b.abs().sum() > 0
        torch.testing.assert_close(sa, sb, rtol=1e-5, atol=0)
        off = (a - b).abs() > 0.13 * torch.maximum(a.abs(), b.abs()) + 2.0**-9
        assert off.float().mean() < 0.02, (j, off.float().mean())
    gaps = [abs(r1[0] - r2[0]) for r1, r2 in zip(out[True].logprobs, out[False].logprobs)]
    assert max(gaps) < 0.05, gaps


@pytest.mark.parametrize("splits", [5, 16, 200, 256])  # 200 / 256: many loop steps of the combine
def test_combine_merges_split_partials_exactly(splits):
    """`combine_splits` against the log-sum-exp merge in float64, with empty splits (lse -1e30, their partials NaN)
    mixed in, and a row whose splits are all empty (a zero-length row: zeros out)."""
    from polyrl.rollout.native.paged_decode import combine_splits

    gen = torch.Generator().manual_seed(splits)
    T, H, Dh = 3, 4, 64
    o = torch.randn(T, H, splits, Dh, generator=gen)
    lse = torch.randn(T, H, splits, generator=gen) * 3
    lse[:, :, 1::3] = -1e30  # empty splits: their partials must not count
    o[:, :, 1::3] = float("nan")  # ... nor be read
    lse[2, 1] = -1e30
    o[2, 1] = 0.0  # an empty row's splits write zeros
    out = combine_splits(o, lse, torch.empty(T, H, Dh))
    w = torch.softmax(lse.double(), -1)
    ref = (torch.nan_to_num(o.double()) * w[..., None]).sum(2)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert out[2, 1].abs().max() == 0


@pytest.mark.parametrize("kv", ["fp32", "fp16", "fp8"])
@pytest.mark.parametrize("splits", [1, 3, 40])
@pytest.mark.parametrize("heads", [(4, 2), (12, 2), (8, 8)])
@pytest.mark.parametrize("norm", [False, True])
def test_rope_form_is_rope_kv_then_decode(kv, splits, heads, norm):
    """`paged_decode_rope` (the qkv GEMM's output in; Qwen3's q/k norm with `norm`, RoPE on q and k, the new token's
    K/V written by the split that holds it, then decode, in one launch) against fused.py's rope_kv followed by
    `paged_decode`: the same output and the same cache, new rows and scales included (an empty row, CUDA-graph
    padding, writes nothing)."""
    from paged_cases import rope_decode_step

    H, KVH = heads
    fp8 = kv == "fp8"
    k, v, scales, bt, seq_slots, _ = _cache(CTX, KVH, fp8, seed=5)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "fp8": torch.bfloat16}[kv]
    if kv == "fp16":
        k, v = k.to(dtype), v.to(dtype)
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(len(CTX), (H + 2 * KVH) * D, generator=gen).to(dtype)
    norms = tuple(1 + torch.randn(D, generator=gen).to(dtype) * 0.1 for _ in range(2)) if norm else None
    ref, ref_cache, *_ = rope_decode_step(qkv, k, v, scales, bt, seq_slots, CTX, splits, H, BS, False, norms=norms)
    out, cache, *_ = rope_decode_step(qkv, k, v, scales, bt, seq_slots, CTX, splits, H, BS, True, norms=norms)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(cache, ref_cache))
    assert not torch.equal(cache[0], k[1:].view(torch.uint8))  # the new rows were written
