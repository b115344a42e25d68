"""The paged prefill kernel (`paged_prefill.py`) under Triton's CPU interpreter, against a float64 reference of causal
attention over the dequantised cache: fp32, fp16 and e4m3 caches (e4m3 with bf16 queries, the engine's case), chunks
with and without a cached prefix, ragged lengths across a q block's edge, GQA groups of 6 and 1, pages out of order.

Skipped unless `triton` imports AND TRITON_INTERPRET=1 (CI has neither). Run it with
`TRITON_INTERPRET=1 PYTHONPATH=/work/triton_site:. python -m pytest -q tests/test_paged_prefill_interp_on_cpu.py`.
"""

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("triton_interpreter_scalars")]

BS, D = 16, 32
# (first position of the chunk, chunk length) per sequence: a fresh 70-token prompt (two q blocks), a 5-token chunk
# after 40 cached tokens, a one-token chunk after 100 (a forked sample's last prompt token)
CHUNKS = [(0, 70), (40, 5), (100, 1)]


def _case(kv, heads, seed=0):
    from paged_cases import shuffled_block_table

    from polyrl.rollout.native.attention import AttnMeta, quantize_fp8_rows

    H, KVH = heads
    gen = torch.Generator().manual_seed(seed)
    ctx = [st + c for st, c in CHUNKS]
    nb = sum(-(-c // BS) for c in ctx) + 2
    k = torch.randn(nb, BS, KVH, D, generator=gen) * 2
    v = torch.randn(nb, BS, KVH, D, generator=gen)
    slots = np.array([2, 0, 3])
    bt = shuffled_block_table(ctx, slots, rows=4, width=max(ctx) // BS + 2, num_blocks=nb, block_size=BS, seed=seed)
    scales = None
    if kv == "fp8":
        k, ks = quantize_fp8_rows(k)
        v, vs = quantize_fp8_rows(v)
        scales = (ks, vs)
    elif kv == "fp16":
        k, v = k.half(), v.half()
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "fp8": torch.bfloat16}[kv]
    lens = np.array([c for _, c in CHUNKS])
    offs = np.concatenate([[0], np.cumsum(lens)[:-1]])
    q = torch.randn(int(lens.sum()), H, D, generator=gen).to(dtype)
    rows = torch.tensor(np.stack([slots, offs, [st for st, _ in CHUNKS], lens]), dtype=torch.int64)
    meta = AttnMeta(slot_mapping=None, block_tables=torch.tensor(bt, dtype=torch.int32), prefill_rows=rows,
                    max_q=int(lens.max()))
    return q, k, v, scales, bt, slots, offs, meta


def _reference(q, k, v, scales, bt, slots, offs):
    """Each chunk token attending to positions 0..its own through its sequence's pages, float64."""
    from paged_cases import dequantised

    ks, vs = scales or (None, None)
    k64, v64 = dequantised(k, ks), dequantised(v, vs)
    T, H, _ = q.shape
    kvh = k.shape[2]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for i, (st, c) in enumerate(CHUNKS):
        for t in range(c):
            pos = np.arange(st + t + 1)
            rows = torch.tensor(bt[slots[i], pos // BS].astype(np.int64) * BS + pos % BS)
            kk = k64.view(-1, kvh, D)[rows].repeat_interleave(H // kvh, 1)
            vv = v64.view(-1, kvh, D)[rows].repeat_interleave(H // kvh, 1)
            att = torch.softmax(torch.einsum("hd,khd->hk", q[offs[i] + t].double(), kk) * D**-0.5, -1)
            out[offs[i] + t] = torch.einsum("hk,khd->hd", att, vv)
    return out


@pytest.mark.parametrize("kv", ["fp32", "fp16", "fp8"])
@pytest.mark.parametrize("heads", [(12, 2), (4, 4)])
def test_prefill_matches_causal_reference(kv, heads):
    from polyrl.rollout.native.paged_prefill import paged_prefill

    q, k, v, scales, bt, slots, offs, meta = _case(kv, heads)
    out = paged_prefill(q, k, v, meta, D**-0.5, *(scales or (None, None)))
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = _reference(q, k, v, scales, bt, slots, offs)
    err = ((out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert err < (1e-5 if kv == "fp32" else 2e-2), (kv, heads, err)


def test_engine_prefill_kernel_matches_gather_path():
    """A tiny engine whose prefill runs through the kernel (interpreted) gives the gather path's greedy tokens and
    log-probs, with a prompt longer than a chunk (a cached prefix for the second chunk) and forked samples."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    m = Qwen2ForCausalLM(cfg).eval()
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 40, 70)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, n=2)
    outs = {}
    for on in (False, True):
        eng = NativeEngine.from_hf(m, device="cpu", dtype=torch.float32, num_kv_tokens=1024,
                                   max_num_batched_tokens=48)
        eng.prefill_kernel = on  # the CUDA default, interpreted here
        outs[on] = eng.generate(prompts, sp)
    assert outs[True].token_ids == outs[False].token_ids
    gap = max(abs(a - b) for r, o in zip(outs[True].logprobs, outs[False].logprobs) for a, b in zip(r, o))
    assert gap < 1e-4, gap
