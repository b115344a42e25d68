"""The 4-GPU plan of a 15B MoE full fine-tune (Qwen3-30B-A3B cut to 24 layers, fp32 master weights, 4 x 139.8 GiB):
the TP chooser and `choose` count the same trainer state beside the engine, and the engine gets a positive KV cache;
where the engine truly does not fit, one sentence (no engine ValueError after planning). Fake memory numbers."""

import pytest
import torch

from polyrl.errors import ConfigError
from polyrl.learner.memory import (GiB, HEADROOM, ModelShape, choose, choose_tp_size, copies_bytes,
                                   engine_weight_bytes, trainer_state_bytes)

TOTAL = int(139.8 * GiB)
# 24 layers of Qwen3-30B-A3B: 15.58B parameters (every expert), fp32 master weights, 4 / 32 kv heads of 128
MOE_24 = ModelShape(hidden=2048, intermediate=8 * 768, num_layers=24, vocab=151936,
                    kv_bytes_per_token=2 * 24 * 4 * 128 * 2, num_params=15_580_000_000,
                    num_trainable=15_580_000_000, param_bytes=4, moe_intermediate=768)


def _plan(free, cfg, world=4, rows=64, seq=4096):
    return choose(MOE_24, device=torch.device("cuda"), free=free, total=TOTAL, max_seq_len=seq, num_rollout_rows=rows,
                  engine_on_device=True, extra_static=copies_bytes(cfg, MOE_24, world), world_size=world,
                  compile_layers=True, checkpointing=None, engine_auto=True,
                  trains=not cfg.actor_rollout_ref.actor.fsdp_config.cpu_offload)  # as plan_memory passes it


def test_15b_moe_full_finetune_on_4_h200s_plans_a_kv_cache():
    from polyrl.trainer.config import PPOConfig

    cfg = PPOConfig()
    # ppo.py keeps the full fp32 policy in host memory on multi-GPU runs: free is the GPU less its context
    free = TOTAL - 1 * GiB
    tp = choose_tp_size(MOE_24, num_heads=32, num_kv_heads=4, gpus_per_node=4,
                        room=int(free - HEADROOM * TOTAL - trainer_state_bytes(cfg, MOE_24, 4)), rows_per_rank=64,
                        max_seq_len=4096, fp8=False, tied=False)
    assert tp.value == 1, tp.reason
    plan = _plan(free, cfg)
    engine = plan["engine"]
    room = float(engine.reason.split("; ")[1].split(" GiB")[0])
    tp_room = float(tp.reason.split("fit the ")[1].split(" GiB")[0])
    assert room == pytest.approx(tp_room, abs=0.15)  # one account of the trainer's state beside the engine
    kv = engine.value * TOTAL - engine_weight_bytes(MOE_24)  # the engine's bf16 weights: 29.0 GiB
    assert engine.value > 0.05 and kv > 12 * GiB, engine.reason  # the whole 64 x 4096 KV cache (12.1 GiB) and more
    fit = int(plan["seats"].reason.split(", ")[1].split()[0])
    assert fit >= 64, plan["seats"].reason  # every row of a generation call at full length


def test_an_engine_that_cannot_fit_is_refused_with_one_sentence():
    from polyrl.trainer.config import PPOConfig

    cfg = PPOConfig()
    # the bug's numbers: the unsharded fp32 policy still on each GPU at plan time (53 GiB free)
    with pytest.raises(ConfigError, match=r"offload_policy=True.*lora_rank"):
        _plan(int(53.0 * GiB), cfg)
    # the first fix it names: FSDP2 keeps weights, gradients and Adam state in host memory, the engine then fits
    cfg.actor_rollout_ref.actor.fsdp_config.offload_policy = True
    assert _plan(int(53.0 * GiB), cfg)["engine"].value > 0.05


def test_expert_weight_casts_shrink_the_update_budget_without_checkpointing():
    """Full fine-tuning in fp32 keeps a bf16 copy of every layer's experts through backward (autocast): the budget
    leaves room for them, all layers' without checkpointing, one layer's with it; LoRA's frozen bf16 experts add none."""
    import dataclasses

    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from polyrl.models.moe import expert_parameters

    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    shape = ModelShape.of(model)
    assert shape.expert_cast_bytes == 2 * sum(p.numel() for p in expert_parameters(model)) > 0
    model.to(torch.bfloat16).requires_grad_(False)
    assert ModelShape.of(model).expert_cast_bytes == 0

    casts = dataclasses.replace(MOE_24, expert_cast_bytes=2 * 14_800_000_000)
    kw = dict(device=torch.device("cuda"), free=TOTAL - GiB, total=TOTAL, max_seq_len=4096, num_rollout_rows=64,
              engine_on_device=False, extra_static=0, world_size=4, compile_layers=True)
    budget = lambda shape, ckpt: choose(shape, checkpointing=ckpt, **kw)["update_tokens"].value  # noqa: E731
    assert budget(casts, False) < budget(MOE_24, False)
    per_token = 24 * 2 * (6 * 2048 + 3 * 8 * 768)  # bf16 activations of 24 compiled layers (memory.py)
    assert budget(MOE_24, False) - budget(casts, False) == pytest.approx(29.6e9 / per_token, rel=0.1)
    assert budget(MOE_24, True) - budget(casts, True) < budget(MOE_24, False) - budget(casts, False)
