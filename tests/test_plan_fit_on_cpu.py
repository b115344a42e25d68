"""benchmarks/plan_fit.py: the memory planner's verdicts for LoRA GRPO of Llama-3.1-70B on 4 GPUs (issue 48) and of
Qwen3-30B-A3B on one GPU (issue 47), on meta-device builds of the real shapes (planner predictions, no GPU). Each
verdict asserted here is checked against the byte arithmetic that implies it."""

import importlib.util
import sys
from pathlib import Path

import pytest

from polyrl.learner.memory import GiB, HEADROOM, engine_weight_bytes

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_fit.py"


@pytest.fixture(scope="module")
def pf():
    spec = importlib.util.spec_from_file_location("plan_fit", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["plan_fit"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def results(pf):
    return {c: pf.plan(c) for c in pf.CASES}


def _one(results, **kw):
    (r,) = [r for c, r in results.items() if all(getattr(c, k) == v for k, v in kw.items())]
    return r


def test_every_case_has_a_verdict_and_its_account(pf, results):
    assert len(results) == len(pf.CASES) >= 8
    for r in results.values():
        assert r["verdict"] in ("fits", "does not fit", "refused")
        assert r["engine_weights"] > 0 and r["tp"] in (1, 2, 4)
        if r["verdict"] == "refused":
            assert r["refusal"].startswith("the rollout engine needs") and r["refusal"].endswith(".")
        else:
            assert r["update_tokens"] >= 4096 and r["kv"] >= 0 and r["activations"] > 0
    table = pf.table(list(results.values()))
    assert table.count("\n") == len(pf.CASES) + 1


def test_70b_lora_on_4_h100s_in_bf16_is_refused_by_the_arithmetic(pf, results):
    r = _one(results, model="Llama-3.1-70B", gpu="H100", fp8=False, offload=False)
    assert r["verdict"] == "refused" and r["tp"] == 4
    shape = pf.lora_policy("Llama-3.1-70B")[0]
    # TP 4's share of the bf16 weights (36.2 GiB) + the 2 GiB reserve + one 4k row of KV, beside the 33 GiB base shard
    need = engine_weight_bytes(shape, 4) + 2 * GiB + (4096 + 32) * shape.kv_bytes_per_token
    room = r["total"] - pf.CONTEXT - HEADROOM * r["total"] - r["trainer_weights"] - r["lora_state"] - r["head"]
    assert need > room
    # FP8 weights let the engine in, but one 4k sequence's activations (checkpointed) do not fit the update
    fp8 = _one(results, model="Llama-3.1-70B", gpu="H100", fp8=True, offload=False)
    assert fp8["verdict"] == "does not fit" and fp8["floor_raised"] and fp8["update_peak"] > fp8["usable"]


def test_70b_lora_fits_4_h200s_at_tp4(results):
    r = _one(results, model="Llama-3.1-70B", gpu="H200", fp8=False)
    assert r["verdict"] == "fits" and r["tp"] == 4 and r["checkpointing"]
    assert r["kv_rows_fit"] >= 64 and max(r["rollout_peak"], r["update_peak"]) <= r["usable"]


def test_30b_a3b_lora_with_expert_adapters_is_refused_on_one_h200(pf, results):
    r = _one(results, model="Qwen3-30B-A3B", gpu="H200", fp8=False, experts=True)
    assert r["verdict"] == "refused"
    # a loaded bf16 base with fp32 expert adapters plus a bf16 engine replica exceed the H200 by themselves
    assert r["trainer_weights"] + r["engine_weights"] > r["usable"]
    attn = _one(results, model="Qwen3-30B-A3B", gpu="H200", fp8=False, experts=False, shared=False)
    assert attn["verdict"] == "fits" and attn["num_trainable"] < r["num_trainable"] / 10
    # an H100 holds no engine copy beside the bf16 training base (57 GiB), even FP8 engine weights (29 GiB)
    for c, h100 in results.items():
        if c.model == "Qwen3-30B-A3B" and c.gpu == "H100" and (c.fp8 or c.experts):
            assert h100["verdict"] == "refused"


def test_30b_a3b_attention_lora_with_the_base_shared_fits_one_h100_and_every_row_on_an_h200(results):
    """The engine uses the frozen bf16 experts in place (NativeEngine.from_hf(share=)): its own weights are the merged
    attention, so an H100 takes the job and an H200 holds all 64 rows' KV at full length (15 with a copy)."""
    copy = _one(results, model="Qwen3-30B-A3B", gpu="H200", fp8=False, experts=False, shared=False)
    for gpu in ("H100", "H200"):
        r = _one(results, model="Qwen3-30B-A3B", gpu=gpu, fp8=False, experts=False, shared=True)
        assert r["verdict"] == "fits" and r["engine_weights"] < 2 * GiB < copy["engine_weights"] / 20
        assert max(r["rollout_peak"], r["update_peak"]) <= r["usable"]
    assert r["kv_rows_fit"] >= 64 > copy["kv_rows_fit"]


def test_lora_state_is_counted_at_the_adapters_fp32_bytes():
    """A bf16 frozen base with peft's fp32 adapters: gradients and two AdamW moments take 12 bytes per adapter
    parameter (the planner once took the first parameter's dtype, the bf16 embedding, and counted 6)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from polyrl.learner.memory import ModelShape

    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1)).to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    shape = ModelShape.of(model)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert shape.param_bytes == 2 and shape.trainable_bytes == 4
    assert shape.state_bytes == 12 * trained


def test_an_fp32_lora_base_that_crowds_out_the_engine_is_refused_naming_the_bf16_base(pf):
    """The default `model.dtype=float32` under LoRA: 30B-A3B's fp32 base (114 GiB) leaves an H200 no room for the
    engine's bf16 copy, and a bf16 base would be the engine's weights themselves: the refusal says so."""
    import dataclasses

    import torch

    from polyrl.errors import ConfigError
    from polyrl.learner.memory import choose

    shape = dataclasses.replace(pf.lora_policy("Qwen3-30B-A3B", False)[0], param_bytes=4)  # the fp32 base
    total = pf.GPUS["H200"]
    with pytest.raises(ConfigError, match=r"model\.dtype=bfloat16"):
        choose(shape, device=torch.device("cuda"), free=total - pf.CONTEXT - shape.num_params * 4, total=total,
               max_seq_len=4096, num_rollout_rows=64, engine_on_device=True, extra_static=0, world_size=1,
               compile_layers=False, checkpointing=None, engine_auto=True)
