"""A LoRA trainer's bf16 frozen base is the native engine's weights on the GPU (CUDA graphs, offload, a whole job).

The CPU file (test_engine_shares_frozen_on_cpu.py) checks the numbers in fp32; here: bf16 on CUDA, where the memory
matters (Qwen3-30B-A3B's 57 GB of experts), with CUDA graphs captured over the shared tensors, an offload round
trip that must leave them in place, and `polyrl train` with LoRA whose engine keeps reading the trainer's experts
and after two updates generates what an engine copied from the trained policy generates.
"""

import pytest
import torch

from polyrl.models.loader import apply_lora, frozen_weights
from polyrl.rollout.base import SamplingParams
from polyrl.rollout.native import NativeEngine
from polyrl.rollout.native.engine import _merged_view

pytestmark = pytest.mark.gpu

PROMPTS = [[3, 17, 90, 4, 50], [8, 8, 1], [20, 10, 50, 25], [7] * 30]


def _moe_config():
    return dict(arch="qwen3_moe", hidden_size=128, layers=2, heads=4, kv_heads=2, intermediate=256, num_experts=16,
                num_experts_per_tok=4)


def _policy(dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    from polyrl.models.tiny import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(100, **_moe_config()), dtype=dtype).cuda()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return apply_lora(model, rank=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=[])


def _engine(policy, share: bool):
    return NativeEngine.from_hf(_merged_view(policy), device="cuda", dtype=torch.bfloat16, num_kv_tokens=8192,
                                max_num_seqs=8, max_model_len=256, share=frozen_weights(policy) if share else None)


def _greedy(engine):
    return engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=24)).token_ids


def _experts(module):
    return {p.data_ptr() for n, p in module.named_parameters() if p.dim() == 3}


def test_cuda_graphs_and_offload_over_shared_weights():
    policy = _policy()
    shared, copied = _engine(policy, share=True), _engine(policy, share=False)
    assert _experts(shared.model) == _experts(policy) and len(_experts(policy)) == 4
    assert shared.weight_bytes() < copied.weight_bytes() / 2
    assert shared.use_graphs and _greedy(shared) == _greedy(copied)
    shared.release_memory(offload_weights=True)  # the trainer keeps its experts on the GPU: they stay put
    assert _experts(shared.model) == _experts(policy)
    assert all(not p.is_cuda for p in shared.own_weights())
    shared.resume()
    assert _greedy(shared) == _greedy(copied)


def test_an_fp32_base_is_not_shared_and_the_planner_counts_only_what_is():
    from polyrl.rollout.config import RolloutConfig
    from polyrl.rollout.native.engine import shared_weight_bytes

    cfg = RolloutConfig(name="native")
    bf16, fp32 = _policy(), _policy(torch.float32)
    assert shared_weight_bytes(cfg, fp32, torch.device("cuda")) == 0
    assert not _engine(fp32, share=True).model.shared
    engine = _engine(bf16, share=True)
    assert shared_weight_bytes(cfg, bf16, torch.device("cuda")) == sum(
        p.numel() * p.element_size() for p in engine.model.parameters() if id(p) in engine.model.shared)


def test_lora_job_keeps_sharing_and_syncs(tmp_path, synth_data_dir):
    from test_engine_shares_frozen_on_cpu import check_lora_job

    check_lora_job(tmp_path, synth_data_dir, "cuda", _moe_config())
