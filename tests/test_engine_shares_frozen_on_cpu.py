"""The native engine uses a LoRA trainer's frozen base in place of a copy (CPU, CI).

Under LoRA the base weights never change, so a rollout engine on the trainer's device and in its dtype can read them
where they lie: `NativeEngine.from_hf(share=loader.frozen_weights(policy))`. On Qwen3-30B-A3B that is the 57 GB of
experts (plus embedding, head, o_proj, router and norms), which is what lets LoRA GRPO of it run on one GPU. Checked
here on a tiny qwen3_moe: the experts really are the trainer's tensors, the engine counts only what it holds, its
tokens and log-probs equal an engine that copied everything, before and after a weight sync of trained adapters,
and full fine-tuning or adapters on the experts share nothing of what they train. The planner takes the shared
bytes off the engine's replica (`shared_weight_bytes`).
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from polyrl.models.loader import apply_lora, frozen_weights, merged_state_dict  # noqa: E402
from polyrl.rollout.base import SamplingParams  # noqa: E402
from polyrl.rollout.native import NativeEngine  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _policy(target_parameters=(), seed=0):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                         tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # spread the routers so that routing differs per token
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return apply_lora(model, rank=4, alpha=8, target_modules="all-linear", target_parameters=list(target_parameters))


def _engine(policy, share: bool):
    from polyrl.rollout.native.engine import _merged_view

    return NativeEngine.from_hf(_merged_view(policy), device="cpu", dtype=torch.float32, num_kv_tokens=2048,
                                max_num_seqs=8, share=frozen_weights(policy) if share else None)


def _generate(engine):
    prompts = [[3, 17, 99, 4, 250], [8, 8, 1], [200, 100, 50, 25]]
    out = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=12))
    return out.token_ids, out.logprobs


def _train_adapters(policy):
    with torch.no_grad():  # lora_B starts at zero: give every adapter a delta, as training would
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)


def _expert_tensors(module):
    return [p for n, p in module.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj",
                                                                    "gate_up", "down")) and p.dim() == 3]


def test_frozen_experts_are_the_trainers_tensors_and_generation_is_unchanged():
    policy = _policy()
    shared, copied = _engine(policy, share=True), _engine(policy, share=False)
    trainer_ptrs = {p.data_ptr() for p in _expert_tensors(policy)}
    engine_ptrs = {p.data_ptr() for p in _expert_tensors(shared.model)}
    assert len(trainer_ptrs) == 4 and engine_ptrs == trainer_ptrs  # 2 layers x (gate_up, down): the same storage
    assert not engine_ptrs & {p.data_ptr() for p in _expert_tensors(copied.model)}
    # the engine counts what it holds: attention's fused q/k/v (LoRA-merged copies) and the dense bits, not experts
    expert_bytes = sum(p.numel() * p.element_size() for p in _expert_tensors(policy))
    assert shared.weight_bytes() <= copied.weight_bytes() - expert_bytes
    tokens, logprobs = _generate(shared)
    ref_tokens, ref_logprobs = _generate(copied)
    assert tokens == ref_tokens
    for a, b in zip(logprobs, ref_logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)


def test_weight_sync_after_training_keeps_the_shared_weights_and_matches_a_copy():
    policy = _policy()
    shared = _engine(policy, share=True)
    before = _generate(shared)[0]
    _train_adapters(policy)
    shared.update_weights(merged_state_dict(policy).items())  # what the trainer sends after an update
    assert {p.data_ptr() for p in _expert_tensors(shared.model)} == {p.data_ptr() for p in _expert_tensors(policy)}
    fresh = _engine(policy, share=False)  # every weight copied from the trained policy
    tokens, ref = _generate(shared)[0], _generate(fresh)[0]
    assert tokens == ref and tokens != before  # the merged attention adapters reached the engine


def test_nothing_trained_is_shared():
    policy = _policy(target_parameters=["experts.gate_up_proj", "experts.down_proj"])  # adapters on the experts
    names = frozen_weights(policy)
    adapted = {n.split(".lora_")[0].replace(".base_layer", "") for n, _ in policy.get_base_model().named_parameters()
               if ".lora_" in n}  # every module carrying an adapter
    assert adapted and not any(n.rsplit(".", 1)[0] in adapted for n in names)
    assert not any(".experts." in n or "q_proj" in n for n in names)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(names)
    full = policy.get_base_model()
    for p in full.parameters():  # full fine-tuning: every weight trains
        p.requires_grad_(True)
    assert frozen_weights(full) == {}


def test_planner_takes_the_shared_bytes_off_the_engine():
    from polyrl.rollout.config import RolloutConfig
    from polyrl.rollout.native.engine import shared_weight_bytes

    policy = _policy()
    shared = _engine(policy, share=True)
    engine_shared = sum(p.numel() * p.element_size() for p in shared.model.parameters()
                        if id(p) in shared.model.shared)
    cfg = RolloutConfig(name="native")
    assert shared_weight_bytes(cfg, policy, torch.device("cpu")) == engine_shared > 0
    cfg.quantization = "fp8"  # FP8 engine weights are the engine's own e4m3 copies
    assert shared_weight_bytes(cfg, policy, torch.device("cpu")) == 0


def check_lora_job(tmp_path, data_dir, device: str, moe: dict):
    """`polyrl train` with LoRA on attention, the base in the engine's dtype on `device` (fp32 on CPU, bf16 on
    CUDA): the engine reads the trainer's experts from its first step to after the last sync, and then generates
    what an engine copied from the trained policy generates."""
    from polyrl.config import build_config
    from polyrl.models.tiny import build_tiny_model
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.ppo import PPOTrainer
    from polyrl.rollout.native.engine import _merged_view

    model_dir = build_tiny_model(tmp_path / "moe", **moe, max_position_embeddings=256)
    argv = [f"data.train_files={data_dir / 'train.parquet'}", "data.train_batch_size=4",
            "data.max_prompt_length=32", "data.max_response_length=8", f"actor_rollout_ref.model.path={model_dir}",
            f"actor_rollout_ref.model.dtype={'bfloat16' if device == 'cuda' else 'float32'}",
            "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
            "actor_rollout_ref.model.target_parameters=[]",
            "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj]",
            "actor_rollout_ref.actor.optim.lr=5e-2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.entropy_coeff=0.05",  # a gradient whatever the rewards
            "actor_rollout_ref.rollout.name=native", "actor_rollout_ref.rollout.n=4", f"trainer.device={device}",
            f"trainer.run_dir={tmp_path / 'run'}", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
            "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.progress_bar=False",
            "trainer.logger=[file]"]
    trainer = PPOTrainer(build_config(PPOConfig(), argv))
    engine = trainer.engine
    assert engine.model.shared and _expert_ptrs(engine.model) <= _expert_ptrs(trainer.model)
    before = {k: v.clone() for k, v in merged_state_dict(trainer.model).items() if "q_proj" in k}
    synced, update = [], engine.update_weights

    def recording(named, **kw):  # every weight sync of the job goes through here (one per step)
        named = list(named)
        synced.append({name for name, _ in named})
        return update(named, **kw)

    engine.update_weights = recording
    trainer.fit()
    after = merged_state_dict(trainer.model)
    assert any(not torch.equal(after[k], v) for k, v in before.items())  # the adapters trained and were merged
    assert _expert_ptrs(engine.model) <= _expert_ptrs(trainer.model)  # still the trainer's tensors after the syncs
    # each sync sends what training changed, the merged attention, and nothing of the frozen base
    assert len(synced) == 2 and all(names == {k for k in after if k.endswith(("q_proj.weight", "k_proj.weight",
                                                                              "v_proj.weight", "o_proj.weight"))}
                                    for names in synced)
    prompts = [[3, 17, 40, 4, 30], [8, 8, 1], [20, 10, 30, 25]]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    if engine.released:
        engine.resume()
    tokens = engine.generate(prompts, greedy).token_ids
    engine.release_memory()  # its KV cache makes room for the copy's
    fresh = NativeEngine.from_hf(_merged_view(trainer.model), device=device, dtype=engine.dtype, num_kv_tokens=4096,
                                 max_num_seqs=8, max_model_len=256)
    assert tokens == fresh.generate(prompts, greedy).token_ids


def _expert_ptrs(module):
    return {p.data_ptr() for n, p in module.named_parameters() if p.dim() == 3}


def test_lora_job_keeps_sharing_and_syncs(tmp_path, synth_data_dir):
    check_lora_job(tmp_path, synth_data_dir, "cpu", dict(arch="qwen3_moe", hidden_size=64, layers=2, heads=4,
                                                         kv_heads=2, intermediate=96, num_experts=8,
                                                         num_experts_per_tok=2))
