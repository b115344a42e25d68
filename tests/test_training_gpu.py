"""Training engine on CUDA: the varlen kernel path equals padded attention under bf16 autocast, and chunked
log-probs use a fraction of the naive path's memory."""

import pytest
import torch

from polyrl.training.actor import ForwardSettings, logprobs_and_entropy
from polyrl.training.batch import build_batch
from polyrl.training.logprobs import chunked_logprobs, naive_logprobs

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
