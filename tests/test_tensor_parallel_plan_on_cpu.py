"""Rollout tensor parallelism's config: the auto size from memory numbers (no GPU needed), and the refusals."""

import pytest

from polyrl.errors import ConfigError
from polyrl.learner.memory import GiB, ModelShape, choose_tp_size, engine_weight_bytes

# Qwen3-32B: 64 layers, hidden 5120, 64 q / 8 kv heads of 128, MLP 25600, vocab 151,936, untied
QWEN3_32B = ModelShape(hidden=5120, intermediate=25600, num_layers=64, vocab=151936,
                       kv_bytes_per_token=2 * 64 * 8 * 128 * 2, num_params=32_762_000_000,
                       num_trainable=32_762_000_000, param_bytes=2)
# Qwen2.5-1.5B: 28 layers, hidden 1536, 12 / 2 heads, MLP 8960, tied
QWEN25_1_5B = ModelShape(hidden=1536, intermediate=8960, num_layers=28, vocab=151936,
                         kv_bytes_per_token=2 * 28 * 2 * 128 * 2, num_params=1_543_714_304,
                         num_trainable=1_543_714_304, param_bytes=2)


def _room(shape, world, lora=False, total=80 * GiB):
    """80 GB less 10% headroom, less the FSDP-sharded trainer (bf16 weights, Adam + grads at 3x, LM-head chunk)."""
    trainer = (shape.num_params * 2 + (0 if lora else shape.num_trainable * 6)) // world + 2048 * shape.vocab * 8
    return int(0.9 * total - trainer)


def test_32b_on_80gb_beside_a_lora_trainer_takes_four_gpus_per_replica():
    c = choose_tp_size(QWEN3_32B, num_heads=64, num_kv_heads=8, gpus_per_node=8, room=_room(QWEN3_32B, 8, lora=True),
                       rows_per_rank=64, max_seq_len=4096, fp8=False, tied=False)
    assert c.value == 4, c.reason
    assert "at 2 they need" in c.reason
    # the arithmetic behind it: TP 2 holds 34.4 GB of weights + 34.6 GB of KV (64 rows x 4k x 256 KiB / 2)
    assert engine_weight_bytes(QWEN3_32B, 2) / GiB == pytest.approx(31.97, abs=0.05)


def test_fp8_weights_count_as_the_alternative_to_a_larger_size():
    room = _room(QWEN3_32B, 8, lora=True)  # 62 GiB: TP 2 needs 66 GiB in bf16, 52 with FP8 weights
    bf16 = choose_tp_size(QWEN3_32B, num_heads=64, num_kv_heads=8, gpus_per_node=8, room=room, rows_per_rank=64,
                          max_seq_len=4096, fp8=False, tied=False)
    fp8 = choose_tp_size(QWEN3_32B, num_heads=64, num_kv_heads=8, gpus_per_node=8, room=room, rows_per_rank=64,
                         max_seq_len=4096, fp8=True, tied=False)
    assert (bf16.value, fp8.value) == (4, 2)
    assert "with FP8 weights" in bf16.reason and "2 GPU(s) per replica would fit" in bf16.reason


def test_1_5b_stays_data_parallel():
    c = choose_tp_size(QWEN25_1_5B, num_heads=12, num_kv_heads=2, gpus_per_node=8, room=_room(QWEN25_1_5B, 8),
                       rows_per_rank=128, max_seq_len=4096, fp8=False, tied=True)
    assert c.value == 1, c.reason


def test_only_sizes_that_split_the_heads_are_candidates():
    # 2 kv heads: 4 GPUs per replica cannot split them, so 2 is the largest candidate even when nothing fits
    c = choose_tp_size(QWEN25_1_5B, num_heads=12, num_kv_heads=2, gpus_per_node=4, room=1 * GiB, rows_per_rank=128,
                       max_seq_len=4096, fp8=False, tied=True)
    assert c.value == 2 and "even at 2" in c.reason


def _cfg(**rollout):
    from polyrl.trainer.config import PPOConfig

    cfg = PPOConfig()
    for k, v in rollout.items():
        setattr(cfg.actor_rollout_ref.rollout, k, v)
    return cfg


def test_set_sizes_are_kept_or_refused_with_one_sentence(monkeypatch):
    from polyrl.trainer.checks import check_tensor_parallel

    monkeypatch.setenv("WORLD_SIZE", "4")
    check_tensor_parallel(_cfg(tensor_model_parallel_size=2))  # divides the 4 processes: kept
    check_tensor_parallel(_cfg(tensor_model_parallel_size=None))  # auto
    for value, words in ((3, "does not divide the 4"), (8, "does not divide the 4"), (0, "at least 1")):
        with pytest.raises(ConfigError, match=words):
            check_tensor_parallel(_cfg(tensor_model_parallel_size=value))
    with pytest.raises(ConfigError, match="native engine only"):
        check_tensor_parallel(_cfg(tensor_model_parallel_size=2, name="hf"))


def test_heads_that_do_not_split_are_refused():
    from polyrl.rollout.native.tensor_parallel import check_divides

    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=4 does not divide the model's "
                                          r"num_key_value_heads=2"):
        check_divides(type("S", (), dict(num_heads=12, num_kv_heads=2, intermediate_size=8960))(), 4)


def test_a_tp_replica_seats_the_rows_of_all_its_ranks():
    """Under TP 4 a replica generates 4 ranks' rows and holds 1/4 of each row's KV per GPU: more seats, same room."""
    import torch

    from polyrl.learner.memory import choose

    kw = dict(device=torch.device("cuda"), free=70 * GiB, total=80 * GiB, max_seq_len=4096, num_rollout_rows=128,
              engine_on_device=True, extra_static=0, world_size=4, compile_layers=True, checkpointing=True,
              update_tokens=8192, trains=False)
    shape = QWEN3_32B
    one = choose(shape, engine_bytes=engine_weight_bytes(shape, 4), tp_size=1, **kw)["seats"]
    four = choose(shape, engine_bytes=engine_weight_bytes(shape, 4), tp_size=4, **kw)["seats"]
    import re

    fit = [int(re.search(r"(\d+) fit the KV cache", c.reason).group(1)) for c in (one, four)]
    assert "128 rows per generation call" in one.reason and "512 rows per generation call" in four.reason
    assert fit[1] >= 4 * fit[0]  # each row costs a quarter of its KV per GPU (39 -> 159 here)


# Qwen3-30B-A3B: 48 layers, hidden 2048, 32 / 4 heads of 128, 128 experts (top-8) of 768, vocab 151,936, untied;
# 30.5B parameters, every expert counted (61 GB in bf16)
QWEN3_30B_A3B = ModelShape(hidden=2048, intermediate=6144, num_layers=48, vocab=151936,
                           kv_bytes_per_token=2 * 48 * 4 * 128 * 2, num_params=30_532_122_624,
                           num_trainable=30_532_122_624, param_bytes=2, moe_intermediate=768)


def test_moe_shape_counts_every_expert_and_its_widths():
    """ModelShape.of on a tiny Qwen3-MoE: num_params holds all experts' weights (HF's fused 3-D tensors), and the
    expert width is known to the TP candidates."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    cfg = Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                         shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)
    shape = ModelShape.of(AutoModelForCausalLM.from_config(cfg))
    experts = 2 * 8 * 3 * 64 * 24  # layers x experts x (gate, up, down) x hidden x moe_intermediate
    assert shape.num_params > experts and (shape.moe_intermediate, shape.shared_intermediate) == (24, 48)
    dense = ModelShape(**{**shape.__dict__, "num_params": shape.num_params - experts})
    assert engine_weight_bytes(shape, 2) - engine_weight_bytes(dense, 2) == experts * 2 // 2  # bf16, 1/2 per rank


def test_qwen3_30b_a3b_on_80gb_takes_two_gpus_per_replica_in_bf16():
    """61 GB of weights (all 128 experts) do not fit one 80 GB GPU beside a LoRA trainer's shards; half of them do."""
    room = _room(QWEN3_30B_A3B, 4, lora=True)
    c = choose_tp_size(QWEN3_30B_A3B, num_heads=32, num_kv_heads=4, gpus_per_node=4, room=room, rows_per_rank=64,
                       max_seq_len=4096, fp8=False, tied=False)
    assert c.value == 2, c.reason
    assert engine_weight_bytes(QWEN3_30B_A3B, 1) / GiB == pytest.approx(56.9, abs=0.1)


def test_only_sizes_that_split_the_experts_are_candidates():
    odd = ModelShape(**{**QWEN3_30B_A3B.__dict__, "moe_intermediate": 12})  # 12 / 8 is not whole
    c = choose_tp_size(odd, num_heads=32, num_kv_heads=8, gpus_per_node=8, room=1 * GiB, rows_per_rank=64,
                       max_seq_len=4096, fp8=False, tied=False)
    assert c.value == 4 and "even at 4" in c.reason
