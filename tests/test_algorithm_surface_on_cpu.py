"""Every algorithm knob of issue 3 runs end to end through `polyrl train` on a tiny model (one or two steps each)."""

import json

import pytest

from polyrl.cli import main as cli_main


def _run(model_dir, data_dir, tmp_path, *extra, steps=1):
    args = ["train", f"data.train_files={data_dir / 'train.parquet'}", f"data.val_files={data_dir / 'val.parquet'}",
            "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=6",
            f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=4", "trainer.logger=[file]",
            f"trainer.run_dir={tmp_path / 'run'}", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
            f"trainer.total_training_steps={steps}", "trainer.progress_bar=False", "trainer.val_before_train=False",
            *extra]
    assert cli_main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "critic/score/mean" in r]


@pytest.mark.parametrize("est", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
                                 "opo", "gpg"])
def test_advantage_estimators(est, tiny_model_dir, synth_data_dir, tmp_path):
    rows = _run(tiny_model_dir, synth_data_dir, tmp_path, f"algorithm.adv_estimator={est}")
    assert "actor/pg_loss" in rows[0] and "critic/advantages/mean" in rows[0]
    if est == "remax":
        assert "timing_s/gen_max" in rows[0]


def test_gae_with_critic_and_warmup(tiny_model_dir, synth_data_dir, tmp_path):
    rows = _run(tiny_model_dir, synth_data_dir, tmp_path, "algorithm.adv_estimator=gae", "trainer.critic_warmup=1",
                "critic.cliprange_value=0.5", steps=2)
    for key in ("critic/vf_loss", "critic/vf_explained_var", "critic/values/mean", "timing_s/values",
                "timing_s/update_critic"):
        assert key in rows[0], key
    assert "actor/pg_loss" not in rows[0]  # critic warm-up: the actor waits one step
    assert "actor/pg_loss" in rows[1]


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov"])
def test_policy_losses(mode, tiny_model_dir, synth_data_dir, tmp_path):
    rows = _run(tiny_model_dir, synth_data_dir, tmp_path, f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}",
                "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.clip_ratio_high=0.28")
    assert "actor/pg_loss" in rows[0]


@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                 "seq-mean-token-sum-norm"])
def test_loss_agg_modes(agg, tiny_model_dir, synth_data_dir, tmp_path):
    rows = _run(tiny_model_dir, synth_data_dir, tmp_path, f"actor_rollout_ref.actor.loss_agg_mode={agg}")
    assert "actor/pg_loss" in rows[0]


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl", "k3+"])
def test_kl_in_loss_and_reward(kind, tiny_model_dir, synth_data_dir, tmp_path):
    rows = _run(tiny_model_dir, synth_data_dir, tmp_path, "actor_rollout_ref.actor.use_kl_loss=True",
                f"actor_rollout_ref.actor.kl_loss_type={kind}", "algorithm.use_kl_in_reward=True",
                "algorithm.kl_ctrl.type=adaptive", steps=2)
    assert "actor/kl_loss" in rows[0] and "actor/reward_kl_penalty" in rows[0]


def test_dapo_dynamic_sampling_and_overlong(tiny_model_dir, synth_data_dir, tmp_path):
    rows = _run(tiny_model_dir, synth_data_dir, tmp_path, "algorithm.filter_groups.enable=True",
                "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=50",
                "actor_rollout_ref.rollout.temperature=1.5",
                "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=3",
                "reward_model.overlong_buffer.penalty_factor=1.0", "reward_model.overlong_buffer.log=True")
    assert rows[0]["train/num_gen_batches"] >= 1
    assert "reward_extra/overlong_reward/mean" in rows[0]
    assert rows[0]["critic/rewards/zero_std_ratio"] == 0.0  # every kept group has a learning signal


def test_validation_n_samples(tiny_model_dir, synth_data_dir, tmp_path):
    args = ["train", f"data.train_files={synth_data_dir / 'train.parquet'}",
            f"data.val_files={synth_data_dir / 'val.parquet'}", "data.train_batch_size=4",
            "data.max_prompt_length=32", "data.max_response_length=6", f"actor_rollout_ref.model.path={tiny_model_dir}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.name=hf", "trainer.logger=[file]", f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.default_local_dir={tmp_path / 'ckpt'}", "trainer.val_only=True", "trainer.progress_bar=False",
            "actor_rollout_ref.rollout.val_kwargs.n=4", "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
            "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"]
    assert cli_main(args) == 0
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("val-core/polyrl/reverse/acc/mean@4", "val-core/polyrl/reverse/acc/best@4/mean",
                "val-core/polyrl/reverse/acc/maj@4/mean"):
        assert key in row, sorted(row)
    assert not (tmp_path / "ckpt").exists()  # val_only trains and saves nothing


def test_generation_dumps(tiny_model_dir, synth_data_dir, tmp_path, capsys):
    _run(tiny_model_dir, synth_data_dir, tmp_path, f"trainer.rollout_data_dir={tmp_path / 'gen'}",
         f"trainer.validation_data_dir={tmp_path / 'valgen'}", "trainer.val_before_train=True",
         "trainer.log_val_generations=2")
    rows = [json.loads(line) for line in (tmp_path / "gen" / "1.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {"input", "output", "score", "step"} <= set(rows[0])
    assert (tmp_path / "valgen" / "1.jsonl").is_file()
    assert "[val 1] prompt=" in capsys.readouterr().out


def test_max_actor_ckpt_to_keep_and_resume_path(tiny_model_dir, synth_data_dir, tmp_path):
    _run(tiny_model_dir, synth_data_dir, tmp_path, "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=2",
         steps=4)
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("global_step_"))
    assert kept == ["global_step_3", "global_step_4"]
    rows = _run(tiny_model_dir, synth_data_dir, tmp_path, "trainer.resume_mode=resume_path",
                f"trainer.resume_from_path={tmp_path / 'ckpt' / 'global_step_3'}", steps=5)
    assert [r["step"] for r in rows][-2:] == [4, 5]  # restarted from step 3, not from the latest (4)


def test_kept_rows_takes_whole_groups_in_order():
    from types import SimpleNamespace

    from polyrl.trainer.rollout_batch import kept_rows

    parts = [{"out": SimpleNamespace(prompt_index=[0, 0, 1, 1, 2, 2]), "keep": {0, 2}},
             {"out": SimpleNamespace(prompt_index=[0, 0, 1, 1]), "keep": {1}}]
    assert kept_rows(parts, 2) == [(0, 0), (0, 1), (0, 4), (0, 5)]
    assert kept_rows(parts, 3) == [(0, 0), (0, 1), (0, 4), (0, 5), (1, 2), (1, 3)]
    assert kept_rows([{"out": SimpleNamespace(prompt_index=[0, 0, 1])}], 1) == [(0, 0), (0, 1), (0, 2)]


def test_dynamic_sampling_with_remax_baselines(tiny_model_dir, synth_data_dir, tmp_path):
    rows = _run(tiny_model_dir, synth_data_dir, tmp_path, "algorithm.adv_estimator=remax",
                "algorithm.filter_groups.enable=True", "algorithm.filter_groups.max_num_gen_batches=50",
                "actor_rollout_ref.rollout.temperature=1.5", f"custom_reward_function.path={_length_reward(tmp_path)}")
    assert "timing_s/gen_max" in rows[0] and rows[0]["critic/rewards/zero_std_ratio"] == 0.0


def _length_reward(tmp_path):
    f = tmp_path / "length_reward.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                 "    return float(len(solution_str))\n")
    return f
