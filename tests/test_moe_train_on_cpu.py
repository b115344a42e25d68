"""A tiny Qwen3-MoE through polyrl's whole trainer on CPU (issue 47): `polyrl train` with routing replay R3 and the
load-balancing loss, stop and resume bitwise, the HF export reloading as the same MoE, and LoRA GRPO on attention
and experts changing only the adapters."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from polyrl.cli import main as cli_main


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe") / "model", arch="qwen3_moe", hidden_size=32, layers=2,
                            heads=2, kv_heads=1, intermediate=64, max_position_embeddings=128)


# a random tiny model never solves the task: reward the response length instead, so GRPO advantages are not all 0
LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str))
"""


def _args(model_dir, data_dir, out, steps, *extra):
    out.mkdir(parents=True, exist_ok=True)
    (out / "length_reward.py").write_text(LENGTH_REWARD)
    return ["train", "algorithm.adv_estimator=grpo", f"custom_reward_function.path={out / 'length_reward.py'}",
            f"data.train_files={data_dir / 'train.parquet'}", "data.train_batch_size=4",
            "data.max_prompt_length=32", "data.max_response_length=6",
            f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=2",
            "trainer.logger=[file]", f"trainer.run_dir={out / 'run'}", f"trainer.default_local_dir={out / 'ckpt'}",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=1", "trainer.progress_bar=False",
            "trainer.val_before_train=False", "trainer.resume_mode=auto", *extra]


R3_AND_AUX = ["actor_rollout_ref.actor.router_replay.mode=R3",
              "actor_rollout_ref.rollout.enable_rollout_routing_replay=True",
              "+actor_rollout_ref.model.override_config.output_router_logits=True"]


def test_moe_r3_train_resume_bitwise_and_export(moe_dir, synth_data_dir, tmp_path, one_thread):
    """Two mini-batches a step, so the second replays routes under changed weights (old log-probs recomputed)."""
    clean, resumed = tmp_path / "clean", tmp_path / "resumed"
    assert cli_main(_args(moe_dir, synth_data_dir, clean, 3, *R3_AND_AUX)) == 0
    rows = [json.loads(line) for line in (clean / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 3
    for key in ("actor/router_agreement", "actor/moe_aux_loss", "rollout_corr/kl"):
        assert key in steps[0], key
    assert steps[0]["actor/router_agreement"] > 0.95  # the hf rollout ran the same module: routes agree
    assert steps[0]["actor/moe_aux_loss"] > 0
    # stop after step 2, resume to 3: the same weights bit for bit
    assert cli_main(_args(moe_dir, synth_data_dir, resumed, 2, *R3_AND_AUX)) == 0
    assert cli_main(_args(moe_dir, synth_data_dir, resumed, 3, *R3_AND_AUX)) == 0
    a = load_file(str(clean / "ckpt" / "global_step_3" / "model.safetensors"))
    b = load_file(str(resumed / "ckpt" / "global_step_3" / "model.safetensors"))
    assert a.keys() == b.keys() and any(".experts." in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the HF export reloads as the same MoE, experts in HF's 3-D layout
    from transformers import AutoModelForCausalLM

    export = AutoModelForCausalLM.from_pretrained(str(clean / "ckpt" / "global_step_3" / "huggingface"))
    assert type(export).__name__ == "Qwen3MoeForCausalLM"
    sd = export.state_dict()
    for k, v in a.items():
        assert torch.equal(sd[k], v.to(sd[k].dtype)), k
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == export.config.num_experts


def test_lora_checkpoint_holds_the_adapters_and_resumes_bitwise(moe_dir, synth_data_dir, tmp_path, one_thread):
    """A LoRA checkpoint keeps the trained parameters only (the frozen base comes back from model.path: 57 GB a
    checkpoint for Qwen3-30B-A3B otherwise), and a run stopped after step 2 resumes to the same step 3 bit for bit."""
    lora = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "actor_rollout_ref.rollout.name=native"]  # resume syncs the adapters into an engine built from the base
    clean, resumed = tmp_path / "clean", tmp_path / "resumed"
    assert cli_main(_args(moe_dir, synth_data_dir, clean, 3, *lora)) == 0
    assert cli_main(_args(moe_dir, synth_data_dir, resumed, 2, *lora)) == 0
    assert cli_main(_args(moe_dir, synth_data_dir, resumed, 3, *lora)) == 0
    a = load_file(str(clean / "ckpt" / "global_step_3" / "model.safetensors"))
    b = load_file(str(resumed / "ckpt" / "global_step_3" / "model.safetensors"))
    assert a and all(".lora_" in k for k in a) and any(".experts." in k for k in a) and a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # step 3's rollout ran on the engine, which got the trained adapters back by the resume's sync: its log-probs
    # against the trainer's (the mismatch KL) are those of the uninterrupted run
    (kl_clean,), (kl_resumed,) = ([json.loads(line)["rollout_corr/kl"] for line in
                                   (d / "run" / "metrics.jsonl").read_text().splitlines()
                                   if '"step": 3' in line and "actor/pg_loss" in line] for d in (clean, resumed))
    assert kl_resumed == kl_clean
    ea, eb = (load_file(str(d / "ckpt" / "global_step_3" / "huggingface" / "model.safetensors"))
              for d in (clean, resumed))
    assert any(".experts." in k for k in ea) and not any("lora" in k for k in ea) and ea.keys() == eb.keys()
    assert all(torch.equal(ea[k], eb[k]) for k in ea)  # the merged export too


def test_r2_replays_the_old_log_prob_pass_routes(moe_dir, synth_data_dir, tmp_path, one_thread):
    """R2: two mini-batches a step, so old log-probs are recomputed; that pass records its routes and the update
    replays them: the first mini-batch (weights unchanged) agrees with them."""
    assert cli_main(_args(moe_dir, synth_data_dir, tmp_path, 1, "actor_rollout_ref.actor.router_replay.mode=R2")) == 0
    (step,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
               if "actor/pg_loss" in line]
    assert "timing_s/old_log_prob" in step and step["actor/router_agreement"] > 0.99


def test_lora_grpo_on_moe_changes_only_the_adapters(moe_dir, synth_data_dir, tmp_path, one_thread):
    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.ppo import PPOTrainer

    args = _args(moe_dir, synth_data_dir, tmp_path, 2, "actor_rollout_ref.model.lora_rank=4",
                 "actor_rollout_ref.model.lora_alpha=8", "actor_rollout_ref.actor.optim.lr=1e-2")[1:]
    trainer = PPOTrainer(build_config(PPOConfig(), args))
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.step()
    trainer.step()
    after = dict(trainer.model.named_parameters())
    changed = {k for k in before if not torch.equal(before[k], after[k].detach())}
    adapters = {k for k in before if ".lora_" in k}
    assert changed and changed <= adapters  # only adapter weights moved
    assert any(".experts." in k for k in changed)  # LoRA on the experts' 3-D tensors (peft target_parameters)
    assert any("self_attn" in k for k in changed)  # and on attention
    # the rollout and the export see the merged weights under HF's names
    from polyrl.models.loader import merged_state_dict

    merged = merged_state_dict(trainer.model)
    base = trainer.model.get_base_model()
    assert "model.layers.0.mlp.experts.gate_up_proj" in merged and not any("lora" in k for k in merged)
    w0 = before["base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj"]
    assert (merged["model.layers.0.mlp.experts.gate_up_proj"] - w0).abs().max() > 0
    with torch.no_grad():
        x = torch.randint(4, 90, (2, 7))
        live = trainer.model(input_ids=x).logits
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_config(base.config)
        plain.load_state_dict(merged)
        torch.testing.assert_close(plain(input_ids=x).logits, live, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_moe_quickstart_learns(tmp_path, monkeypatch):
    """`polyrl quickstart --arch qwen3_moe`'s path, shortened: a tiny Qwen3-MoE (8 experts, 2 a token), a shorter SFT
    warm-up on the noisy demonstrations, then GRPO through PPOTrainer with the native engine's MoE layers and R3
    routing replay; held-out greedy accuracy must rise. 12 GRPO steps gave +6 points in one CI run and more in another
    (thread counts change the numerics), so it runs 20. Cost: ~40 s wall on the 2-core machine (500 s when its
    rollouts ran on the hf backend, before the engine had MoE layers)."""
    from polyrl.trainer.quickstart import QuickstartSettings, run_quickstart

    monkeypatch.setenv("POLYRL_CACHE", str(tmp_path / "cache"))
    settings = QuickstartSettings(arch="qwen3_moe", sft_steps=200, sft_batch=32, num_train=1000, grpo_steps=20,
                                  prompts_per_step=16, num_val=100)
    r = run_quickstart(str(tmp_path / "qs"), settings=settings)
    assert r["accuracy_after"] - r["accuracy_before"] >= 0.08, r
    rows = [json.loads(line) for line in (tmp_path / "qs" / "metrics.jsonl").read_text().splitlines()]
    scores = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    assert np.mean(scores[-4:]) > np.mean(scores[:4]), scores  # the training reward rises too
