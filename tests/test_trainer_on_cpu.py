"""The RL trainer on CPU: split invariance, on-policy ratio, NaN safety, the train CLI end to end, and learning."""

import copy
import json

import pytest
import torch

from polyrl.algorithms.losses import LossKnobs
from polyrl.cli import main as cli_main
from polyrl.models.loader import load_causal_lm
from polyrl.learner import actor as actor_mod
from polyrl.learner.actor import Actor, UpdateSettings, compute_logprobs, make_scheduler
from polyrl.learner.batch import build_batch


def _batch(model_dir, num_rows=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 90, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(num_rows)]
    responses = [torch.randint(4, 90, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(num_rows)]
    batch = build_batch(prompts, responses, pad_token_id=0, device=torch.device("cpu"))
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]
    return batch


def _actor(model, lr=1e-2, sgd=False):
    # SGD keeps the update linear in the gradient, so an invariance test compares gradients, not Adam's sign flips
    opt = (torch.optim.SGD(model.parameters(), lr=1.0) if sgd
           else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0))
    return Actor(model, opt, make_scheduler(opt, total_steps=10, warmup_steps=0, kind="constant", min_lr_ratio=0.0,
                                            num_cycles=0.5))


def _settings(**kw):
    base = dict(mini_batch_size=8, micro_batch_size=8, ppo_epochs=1, temperature=1.0, loss_mode="vanilla",
                loss_agg_mode="token-mean", knobs=LossKnobs(), grad_clip=1e9, entropy_coeff=0.01,
                use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    base.update(kw)
    return UpdateSettings(**base)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_1x8_equals_8x1(tiny_model_dir, mode):
    base = load_causal_lm(str(tiny_model_dir))
    batch = _batch(tiny_model_dir)
    batch["old_log_probs"] = compute_logprobs(base, batch, temperature=1.0, micro_batch_size=8) + 0.05
    batch["ref_log_probs"] = batch["old_log_probs"] - 0.1
    results = []
    for micro in (8, 1):
        model = copy.deepcopy(base)
        _actor(model, sgd=True).update(batch, _settings(micro_batch_size=micro, loss_agg_mode=mode))
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    moved = (results[0] - torch.cat([p.detach().flatten() for p in base.parameters()])).abs().max()
    assert moved > 1e-4  # the update did something
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-6)


def test_first_mini_batch_of_on_policy_step_has_ratio_exactly_one(tiny_model_dir, monkeypatch):
    model = load_causal_lm(str(tiny_model_dir))
    batch = _batch(tiny_model_dir)
    s = _settings(mini_batch_size=4, micro_batch_size=2, use_kl_loss=False)
    batch["old_log_probs"] = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=s.micro_batch_size)
    gaps = []
    real = actor_mod.policy_loss

    def spy(name, **kw):
        gaps.append(float((kw["log_prob_BT"].detach() - kw["old_log_prob_BT"]).abs().max()))
        return real(name, **kw)

    monkeypatch.setattr(actor_mod, "policy_loss", spy)
    metrics = _actor(model).update(batch, s)
    assert gaps[0] == 0.0 and gaps[1] == 0.0  # both micro-batches of the first mini-batch: ratio exactly 1
    assert max(gaps[2:]) > 0.0  # after the first optimizer step the policy has moved
    assert metrics["actor/pg_clipfrac"] >= 0.0


def test_nonfinite_gradient_skips_the_update(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir))
    before = copy.deepcopy(model.state_dict())
    batch = _batch(tiny_model_dir)
    batch["old_log_probs"] = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=8)
    batch["advantages"][0, 0] = float("nan")
    metrics = _actor(model).update(batch, _settings(use_kl_loss=False))
    assert metrics["actor/nonfinite_skipped"] == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _train_args(model_dir, data_dir, tmp_path, *extra):
    return [
        "train",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data_dir / 'train.parquet'}",
        f"data.val_files={data_dir / 'val.parquet'}",
        "data.train_batch_size=4",
        "data.max_prompt_length=32",
        "data.max_response_length=6",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.n=4",
        "+trainer.logger=[console,file,tensorboard]",
        f"trainer.run_dir={tmp_path / 'run'}",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        "trainer.total_training_steps=2",
        "trainer.progress_bar=False",
        *extra,
    ]


def test_train_cli_end_to_end(tiny_model_dir, synth_data_dir, tmp_path):
    assert cli_main(_train_args(tiny_model_dir, synth_data_dir, tmp_path, "trainer.save_freq=1")) == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in ("timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/ref", "timing_s/adv",
                "timing_s/update_actor", "timing_s/update_weights", "timing_s/step", "perf/throughput",
                "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "response_length/mean",
                "critic/advantages/mean", "training/rollout_probs_diff_mean"):
        assert key in steps[0], key
    assert steps[0]["training/rollout_probs_diff_mean"] < 1e-4  # same weights, same math: engine == trainer
    assert any(k.startswith("val-core/polyrl/reverse/acc/mean@1") for k in rows[0])
    assert (run / "config.yaml").is_file() and (run / "env.json").is_file()
    assert list((run / "tensorboard").glob("events.*"))
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (ckpt / "global_step_1" / "model.safetensors").is_file()
    export = ckpt / "global_step_2" / "huggingface"
    reloaded = load_causal_lm(str(export))  # the HF export loads with the plain transformers path
    assert sum(p.numel() for p in reloaded.parameters()) > 0

    # resume_mode=auto picks up at step 2 and trains one more step
    assert cli_main(_train_args(tiny_model_dir, synth_data_dir, tmp_path, "trainer.total_training_steps=3",
                                "trainer.val_before_train=False")) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "critic/score/mean" in r][-1] == 3
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_user_errors_print_one_sentence(tiny_model_dir, synth_data_dir, tmp_path, capsys):
    code = cli_main(_train_args(tiny_model_dir, synth_data_dir, tmp_path, "actor_rollout_ref.actor.ppo_mini_batch=2"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert "did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'" in err[-1]
    code = cli_main(_train_args(tiny_model_dir, synth_data_dir, tmp_path, "data.train_batch_size=3"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "train_batch_size=3" in err[-1] and "ppo_mini_batch_size=2" in err[-1]


def test_quickstart_learns(tmp_path, monkeypatch, quickstart_cache):
    """The embedded default's own path, shortened: held-out greedy accuracy must rise by >= 20 points."""
    from polyrl.trainer.quickstart import run_quickstart

    monkeypatch.setenv("POLYRL_CACHE", str(quickstart_cache))
    r = run_quickstart(str(tmp_path / "qs"), fast=True)  # the default engine: rollout.name=native
    assert r["accuracy_after"] - r["accuracy_before"] >= 0.20, r
    assert (tmp_path / "qs" / "metrics.jsonl").is_file()


def test_update_metrics_are_plain_numbers(tiny_model_dir):
    """Loggers and users get floats, not device tensors (a tensor here once broke pytest.approx and JSON dumps)."""
    model = load_causal_lm(str(tiny_model_dir))
    batch = _batch(tiny_model_dir)
    batch["old_log_probs"] = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=8)
    batch["ref_log_probs"] = batch["old_log_probs"]
    metrics = _actor(model).update(batch, _settings(micro_batch_size=2))
    bad = {k: type(v).__name__ for k, v in metrics.items() if not isinstance(v, (int, float))}
    assert not bad, bad
