"""Model options through `polyrl train`: LoRA (synced merged into the native engine, exported merged),
gradient checkpointing, and the default native engine's resume state."""

import torch

from polyrl.models.loader import load_causal_lm, load_tokenizer, merged_state_dict
from polyrl.rollout.base import SamplingParams
from polyrl.trainer.config import PPOConfig


def _cfg(model_dir, data_dir, tmp_path, *extra):
    from polyrl.config import build_config

    # a random tiny model never solves the task; reward length instead so GRPO advantages are not all zero
    reward = tmp_path / "length_reward.py"
    tmp_path.mkdir(parents=True, exist_ok=True)
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                      "    return float(len(solution_str))\n")
    return build_config(PPOConfig(), [f"custom_reward_function.path={reward}",
        f"data.train_files={data_dir / 'train.parquet'}", "data.train_batch_size=4", "data.max_prompt_length=32",
        "data.max_response_length=6", f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.actor.optim.lr=5e-2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=2",
        "trainer.logger=[file]", f"trainer.run_dir={tmp_path / 'run'}", f"trainer.default_local_dir={tmp_path / 'ck'}",
        "trainer.progress_bar=False", "trainer.val_before_train=False", *extra])


def test_lora_syncs_merged_weights_into_native_engine_and_exports_merged(tiny_model_dir, synth_data_dir, tmp_path):
    from polyrl.trainer.ppo import PPOTrainer

    cfg = _cfg(tiny_model_dir, synth_data_dir, tmp_path, "actor_rollout_ref.model.lora_rank=4",
               "actor_rollout_ref.model.lora_alpha=8", "actor_rollout_ref.model.target_modules=all-linear",
               "actor_rollout_ref.rollout.name=native", "trainer.total_training_steps=2")
    trainer = PPOTrainer(cfg)
    trainer.fit()
    merged = merged_state_dict(trainer.model)
    base = load_causal_lm(str(tiny_model_dir)).state_dict()
    assert any(not torch.equal(merged[k], base[k]) for k in base if "proj" in k)  # the adapters learned something
    # the engine decodes with the merged weights: greedy output equals HF generate on the merged model
    export = trainer.final_checkpoint / "huggingface"
    hf = load_causal_lm(str(export))
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(v, merged[k])
    tok = load_tokenizer(str(export))
    prompts = [trainer.train_data[i].prompt_ids for i in range(3)]
    trainer.engine.resume()
    out = trainer.engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=5))
    for p, got in zip(prompts, out.token_ids):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False, eos_token_id=None,
                          pad_token_id=tok.pad_token_id)
        assert ref[0, len(p):].tolist() == got


def test_gradient_checkpointing_gives_the_same_update(tiny_model_dir, synth_data_dir, tmp_path):
    from polyrl.trainer.ppo import PPOTrainer

    weights = []
    for ckpt in (False, True):
        cfg = _cfg(tiny_model_dir, synth_data_dir, tmp_path / str(ckpt), "trainer.total_training_steps=1",
                   f"actor_rollout_ref.model.enable_gradient_checkpointing={ckpt}", "trainer.resume_mode=disable")
        t = PPOTrainer(cfg)
        t.step()
        weights.append(torch.cat([p.detach().flatten() for p in t.model.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=1e-6)


def test_native_engine_rng_position_is_checkpointed(tiny_model_dir, synth_data_dir, tmp_path):
    from polyrl.trainer.ppo import PPOTrainer

    cfg = _cfg(tiny_model_dir, synth_data_dir, tmp_path, "trainer.total_training_steps=2", "trainer.save_freq=1")
    t = PPOTrainer(cfg)
    t.fit()
    assert t.engine.num_calls >= 2
    resumed = PPOTrainer(_cfg(tiny_model_dir, synth_data_dir, tmp_path, "trainer.total_training_steps=3"))
    assert resumed.global_step == 2 and resumed.engine.num_calls == t.engine.num_calls
