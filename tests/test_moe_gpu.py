"""MoE training on a GPU (issue 47): transformers' grouped_mm experts under bf16 autocast and the packed varlen
forward, with routing replay, against the eager experts loop."""

import pytest
import torch

from polyrl.learner.actor import ForwardSettings, compute_logprobs
from polyrl.learner.batch import build_batch
from polyrl.models.moe import MoERouting

pytestmark = pytest.mark.gpu


def _moe():
    from transformers import AutoModelForCausalLM

    from polyrl.models.tiny import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(100, arch="qwen3_moe", hidden_size=128, layers=2, heads=4, kv_heads=2, intermediate=256,
                      num_experts=16, num_experts_per_tok=4)
    return AutoModelForCausalLM.from_config(cfg).cuda()


def _batch(rows=8):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 90, (int(torch.randint(8, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]
    resp = [torch.randint(4, 90, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(rows)]
    return build_batch(prompts, resp, pad_token_id=0, device=torch.device("cuda"))


def test_grouped_mm_matches_eager_experts_and_replay_is_exact_packed():
    model = _moe()
    batch = _batch()
    fwd = ForwardSettings(routing=MoERouting(model), replay_routes=True)  # packed (CUDA), bf16 autocast
    assert model.config._experts_implementation == "grouped_mm"
    logp, routes = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=4, fwd=fwd, record_routes=True)
    model.config._experts_implementation = "eager"  # read at call time by each experts module
    batch["routed_experts"] = routes  # eager experts on the same routes: the same numbers up to bf16 rounding
    eager = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=8, fwd=fwd)
    mask = batch["response_mask"].bool()
    assert (eager - logp)[mask].abs().max() < 5e-2
    model.config._experts_implementation = "grouped_mm"
    again = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=8, fwd=fwd)  # another micro-batch split
    assert (again - logp)[mask].abs().max() < 5e-2


def test_compiled_layers_over_fp32_masters_run_bf16_grouped_gemms():
    """The trainer's case: fp32 master weights, compiled decoder layers, bf16 autocast. HF's own experts forward
    falls back to a per-expert fp32 loop there; polyrl's (models/moe.grouped_experts) runs `_grouped_mm` in bf16."""
    from polyrl.learner.actor import compile_decoder_layers
    from polyrl.models.moe import grouped_experts

    model = _moe()
    batch = _batch()
    fwd = ForwardSettings(routing=MoERouting(model))
    want = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=8, fwd=fwd)  # HF's, eager
    assert grouped_experts(model) == 2
    compile_decoder_layers(model)
    with torch.profiler.profile() as prof:
        got = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=8, fwd=fwd)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_grouped_mm" in ops and not any("fallback" in k for k in ops), sorted(ops)
    mask = batch["response_mask"].bool()
    assert (want - got)[mask].abs().max() < 5e-2
