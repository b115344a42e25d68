"""The paged prefill kernel (`paged_prefill.py`) on CUDA: against the gather path's attention on the same cache (bf16
and e4m3, Qwen-1.5B heads, chunks with and without a cached prefix), and the engine with it against the engine with
the gather path (the log-prob gap to HF no wider).

Run on the GPU machine: `PYTHONPATH=. python -m pytest -q tests/test_paged_prefill_gpu.py -s`.
"""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_kernel_matches_gather_attention(fp8):
    from paged_cases import shuffled_block_table

    from polyrl.rollout.native.attention import AttnMeta, gather_attention, quantize_fp8_rows
    from polyrl.rollout.native.paged_prefill import paged_prefill

    torch.manual_seed(0)
    BS, H, KVH, D = 16, 12, 2, 128
    chunks = [(0, 256), (0, 1), (300, 200), (64, 7), (1000, 129)]  # (first position, length)
    ctx = [st + c for st, c in chunks]
    nb = sum(-(-c // BS) for c in ctx) + 2
    k = torch.randn(nb, BS, KVH, D, device="cuda", dtype=torch.bfloat16) * 2
    v = torch.randn(nb, BS, KVH, D, device="cuda", dtype=torch.bfloat16)
    scales = (None, None)
    if fp8:
        (k, ks), (v, vs) = quantize_fp8_rows(k), quantize_fp8_rows(v)
        scales = (ks, vs)
    slots = np.array([4, 0, 2, 1, 3])
    bt = torch.tensor(shuffled_block_table(ctx, slots, rows=5, width=max(ctx) // BS + 2, num_blocks=nb, block_size=BS),
                      dtype=torch.int32, device="cuda")
    lens = np.array([c for _, c in chunks])
    starts = np.array([st for st, _ in chunks])
    offs = np.concatenate([[0], np.cumsum(lens)[:-1]])
    T, Q, K = int(lens.sum()), int(lens.max()), int(max(ctx))
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    rows = torch.tensor(np.stack([slots, offs, starts, lens]), device="cuda")
    out = paged_prefill(q, k, v, AttnMeta(slot_mapping=None, block_tables=bt, prefill_rows=rows, max_q=Q), D**-0.5,
                        *scales)
    # the gather path's metadata, as the engine builds it
    j, kk = np.arange(Q)[None, :], np.arange(K)[None, :]
    q_index = np.where(j < lens[:, None], offs[:, None] + j, T)
    out_index = np.concatenate([i * Q + np.arange(c) for i, c in enumerate(lens)])
    pos = np.minimum(kk, starts[:, None] + lens[:, None] - 1)
    gather = bt.cpu().numpy()[slots[:, None], pos // BS].astype(np.int64) * BS + pos % BS
    qpos = starts[:, None, None] + j[..., None]
    mask = (kk[:, None, :] <= qpos) & (kk[:, None, :] < (starts + lens)[:, None, None])
    t = lambda a: torch.tensor(a, device="cuda")  # noqa: E731
    ref = gather_attention(q, k, v, AttnMeta(slot_mapping=None, gather_slots=t(gather), q_index=t(q_index),
                                             out_index=t(out_index), mask=t(mask[:, None])), D**-0.5, *scales)
    err = ((out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).max().item()
    print(f"prefill kernel vs gather path (fp8={fp8}): max relative error per row {err:.1e}")
    assert err < 2e-2, err


@pytest.mark.parametrize("fp8", [False, True])
def test_engine_with_prefill_kernel_decodes_as_with_gather(fp8):
    from logprob_gap import hf_logprob_gap, mlp15b_model

    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine

    m = mlp15b_model()
    g = torch.Generator().manual_seed(4)
    lengths = torch.randint(5, 600, (48,), generator=g)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in lengths]
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3, ignore_eos=True, n=2)
    kw = dict(kv_cache_dtype="fp8", quantization="fp8") if fp8 else {}
    outs, gaps = {}, {}
    for on in (False, True):
        eng = NativeEngine.from_hf(m, num_kv_tokens=1 << 16, max_num_batched_tokens=2048, **kw)
        eng.prefill_kernel = on
        outs[on] = eng.generate(prompts, sp)
        gaps[on] = hf_logprob_gap(m, [p for p in prompts for _ in range(2)], outs[on])
        del eng
        torch.cuda.empty_cache()
    same = sum(a == b for r, o in zip(outs[False].token_ids, outs[True].token_ids) for a, b in zip(r, o))
    total = sum(len(r) for r in outs[False].token_ids)
    print(f"prefill kernel (fp8={fp8}): {same}/{total} tokens as the gather path; log-prob gap to HF {gaps[True]:.2e} "
          f"against {gaps[False]:.2e}")
    # sampled tokens part ways after the first flip (H100, 2026-11-27: 1,144 / 1,536 the same in bf16, 352 in FP8,
    # whose near-uniform random-weight distributions flip more), so the check is the distance to HF: a wrong
    # attention over the prompts would move every later token's log-prob
    assert gaps[True] <= 1.25 * gaps[False] + 1e-3, gaps
