"""Training engine on CUDA: the varlen kernel path equals padded attention under bf16 autocast, and chunked
log-probs use a fraction of the naive path's memory."""

import pytest
import torch

from polyrl.learner.actor import ForwardSettings, logprobs_and_entropy
from polyrl.learner.batch import build_batch
from polyrl.learner.logprobs import chunked_logprobs, naive_logprobs

pytestmark = pytest.mark.gpu


def _model():
    from transformers import AutoModelForCausalLM

    from polyrl.models.tiny import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(1000, arch="qwen2", hidden_size=256, layers=2, heads=4, kv_heads=2, intermediate=512, tie=False)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg).cuda()


def test_varlen_packed_equals_padded_in_bf16():
    model = _model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 1000, (int(n),), generator=g).tolist() for n in torch.randint(5, 60, (8,), generator=g)]
    resps = [torch.randint(4, 1000, (int(n),), generator=g).tolist() for n in torch.randint(1, 80, (8,), generator=g)]
    batch = build_batch(prompts, resps, pad_token_id=0, device=torch.device("cuda"))
    with torch.no_grad():
        packed, ent_p = logprobs_and_entropy(model, batch, 1.0, True, ForwardSettings(use_remove_padding=True))
        padded, ent_d = logprobs_and_entropy(model, batch, 1.0, True, ForwardSettings(use_remove_padding=False))
    mask = batch["response_mask"].bool()
    # both in bf16 compute; kernels differ (flash varlen vs SDPA with a padding mask): bf16-level agreement
    assert (packed - padded)[mask].abs().max() < 0.05
    assert (packed - padded)[mask].abs().mean() < 0.005
    assert (ent_p - ent_d)[mask].abs().max() < 0.05
    assert model.config._attn_implementation == "sdpa"


def test_chunked_logprobs_use_less_memory_and_agree():
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(4096, 512, device="cuda", generator=g, requires_grad=True)
    w = (torch.randn(32000, 512, device="cuda", generator=g) * 0.05).requires_grad_()
    y = torch.randint(0, 32000, (4096,), device="cuda", generator=g)
    peaks, outs = [], []
    for fn in (naive_logprobs, lambda *a, **k: chunked_logprobs(*a, chunk_size=512, **k)):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logp, ent = fn(h, w, y, with_entropy=True)
        (logp.sum() + ent.sum()).backward()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        outs.append((logp.detach(), ent.detach(), h.grad.clone()))
    assert peaks[1] < 0.35 * peaks[0], peaks
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_triton_kernels_match_torch_formulas(dtype):
    """The Triton row passes of fused_head equal its torch formulas (values and all three gradients), 152k vocab."""
    from polyrl.learner import fused_head
    from polyrl.learner.logprobs import naive_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    M, D, V = 3000, 256, 151936
    h0 = torch.randn(M, D, device="cuda", generator=g)
    w0 = torch.randn(V, D, device="cuda", generator=g) * 0.05
    b0 = torch.randn(V, device="cuda", generator=g) * 0.1
    y = torch.randint(0, V, (M,), device="cuda", generator=g)
    g_logp, g_ent = torch.randn(M, device="cuda", generator=g), torch.randn(M, device="cuda", generator=g)
    outs = []
    for fn in (lambda *a, **k: naive_logprobs(*a, **k),
               lambda *a, **k: fused_head.fused_logprobs(*a, chunk_size=1024, **k)):
        h, w, b = (t.clone().to(dtype).requires_grad_() for t in (h0, w0, b0))
        logp, ent = fn(h, w, y, bias_V=b, temperature=0.7, with_entropy=True)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        outs.append([t.float() for t in (logp.detach(), ent.detach(), h.grad, w.grad, b.grad)])
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, ref, got in zip(("logp", "ent", "dh", "dw", "db"), *outs):
        torch.testing.assert_close(got, ref, **tol, msg=name)


def test_shared_prompt_flash_attention_matches_the_dense_mask():
    """The gathered-K/V flash call (causal from each segment's bottom-right) == SDPA with the explicit mask."""
    from polyrl.learner.packing import _cuda_varlen_kv, _exclusive_cumsum
    from polyrl.learner.shared_prefix import shared_prompt_attention

    prompt_lens, resp_lens = [37, 128, 5], [[100, 3, 260], [1, 64], [500]]
    flat = [(g, r) for g, rs in enumerate(resp_lens) for r in rs]
    p_start = [sum(prompt_lens[:g]) for g in range(3)]
    num_prompt = sum(prompt_lens)
    r_start = [num_prompt + sum(r for _, r in flat[:j]) for j in range(len(flat))]
    kv = [list(range(p_start[g], p_start[g] + prompt_lens[g])) for g in range(3)]
    kv += [kv[g] + list(range(r_start[j], r_start[j] + r)) for j, (g, r) in enumerate(flat)]
    t = lambda x: torch.tensor(x, device="cuda")  # noqa: E731
    cu = _exclusive_cumsum(t(prompt_lens + [r for _, r in flat]))
    cu_kv = _exclusive_cumsum(t([len(x) for x in kv]))
    kv_index = t([i for x in kv for i in x])
    N = num_prompt + sum(r for _, r in flat)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(N, h, 128, device="cuda", generator=g, dtype=torch.bfloat16) for h in (12, 2, 2))
    dout = torch.randn(N, 12, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    results = []
    for flash in (True, False):
        leaves = [x.detach().clone().float().requires_grad_() for x in (q, k, v)]
        args = [x.to(torch.bfloat16) if flash else x for x in leaves]
        out = shared_prompt_attention(*args, cu, 500, cu_kv, kv_index, max(len(x) for x in kv), None,
                                      varlen=_cuda_varlen_kv if flash else None)
        (out.float() * dout.float()).sum().backward()
        results.append([out.float()] + [x.grad for x in leaves])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        err = (a - b).abs().max().item()
        assert err < 0.02 * b.abs().max().item(), (name, err)


def test_shared_prompt_logprobs_equal_unshared_in_bf16():
    model = _model()
    g = torch.Generator().manual_seed(1)
    prompts, resps = [], []
    for _ in range(3):
        p = torch.randint(4, 1000, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g).tolist()
        for _ in range(4):
            prompts.append(p)
            resps.append(torch.randint(4, 1000, (int(torch.randint(1, 80, (1,), generator=g)),), generator=g).tolist())
    batch = build_batch(prompts, resps, pad_token_id=0, device=torch.device("cuda"))
    with torch.no_grad():
        shared, ent_s = logprobs_and_entropy(model, batch, 1.0, True, ForwardSettings(share_prompts=True))
        plain, ent_p = logprobs_and_entropy(model, batch, 1.0, True, ForwardSettings(share_prompts=False))
    mask = batch["response_mask"].bool()
    assert (shared - plain)[mask].abs().max() < 0.05
    assert (shared - plain)[mask].abs().mean() < 0.005
    assert (ent_s - ent_p)[mask].abs().max() < 0.05
