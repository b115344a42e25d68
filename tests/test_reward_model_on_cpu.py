"""Model-based rewards (rewards/model_reward.py, reward_model.py, judge.py) on CPU, with models the tests train
(models/tiny_reward.py).

The property: the fraction of a response's characters that are digits. A random tiny policy writes ~10% digits
(10 of the char tokenizer's ~100 printable tokens).
- A tiny sequence classifier is trained here to score that fraction from the rendered chat; GRPO with
  `reward_model.enable=True` (no rule reward at all) then raises the policy's digit fraction.
- A tiny causal LM is trained here as a judge that answers "1" when the response holds a digit and "0" when not; the
  same GRPO run through the native engine raises the digit fraction too.
Each learning test asserts a rise of the measured property, not of the model's own score.
"""

from __future__ import annotations

import random

import pytest
import torch

from polyrl.config import build_config
from polyrl.errors import ConfigError, UserError
from polyrl.models.tiny_reward import (
    digit_fraction,
    random_response,
    task_chats,
    train_digit_classifier,
    train_digit_judge,
)
from polyrl.trainer.config import PPOConfig


@pytest.fixture(scope="module")
def single_thread():
    """Torch on one thread for the module's training fixtures (see conftest.one_thread: a shared 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def digit_rm(tmp_path_factory, single_thread):
    """A tiny sequence classifier trained to score a response's digit fraction (models/tiny_reward.py)."""
    from polyrl.rewards.reward_model import DiscriminativeRM

    out = train_digit_classifier(tmp_path_factory.mktemp("rm") / "digit_rm")
    rm = DiscriminativeRM.load(str(out), key="k", device=torch.device("cpu"), dtype=torch.float32, max_tokens=None,
                          max_rows=64)
    rng, chats = random.Random(9), task_chats(16, seed=8)
    resp = [random_response(rng) for _ in range(100)]
    got = torch.tensor(rm.score([rng.choice(chats) for _ in resp], resp))
    want = torch.tensor([digit_fraction(r) for r in resp])
    assert torch.corrcoef(torch.stack([got, want]))[0, 1] > 0.9  # the RM learned the property
    return out


def _grpo(model_dir, data_dir, tmp_path, *extra) -> list[str]:
    return [f"data.train_files={data_dir / 'train.parquet'}", "data.train_batch_size=16", "data.max_prompt_length=32",
            "data.max_response_length=6", f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.actor.optim.lr=2e-2", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128", "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.entropy_coeff=0", "trainer.logger=[file]", f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.default_local_dir={tmp_path / 'ck'}", "trainer.progress_bar=False",
            "trainer.val_before_train=False", "trainer.resume_mode=disable", "trainer.save_freq=-1", *extra]


def _policy_digit_fraction(trainer) -> float:
    from polyrl.rollout import SamplingParams

    prompts = [s.prompt_ids for s in trainer.train_data[:32]]
    trainer.engine.resume()
    out = trainer.engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=7,
                                                          stop_token_ids=trainer.stop_ids))
    texts = trainer.tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
    return sum(map(digit_fraction, texts)) / len(texts)


def _learns(cfg) -> tuple[float, float, list[dict]]:
    from polyrl.trainer.ppo import PPOTrainer

    torch.manual_seed(0)
    trainer = PPOTrainer(cfg)
    before = _policy_digit_fraction(trainer)
    logs = [trainer.step() for _ in range(cfg.trainer.total_training_steps)]
    trainer.engine.update_weights(trainer._weights_for_rollout())
    return before, _policy_digit_fraction(trainer), logs


def test_grpo_learns_what_a_trained_reward_model_prefers(digit_rm, tiny_model_dir, synth_data_dir, tmp_path):
    cfg = build_config(PPOConfig(), _grpo(tiny_model_dir, synth_data_dir, tmp_path, "trainer.total_training_steps=8",
                                          "reward_model.enable=True", f"reward_model.model.path={digit_rm}",
                                          "reward_model.use_dynamic_bsz=True",
                                          "reward_model.forward_max_token_len_per_gpu=2048"))
    before, after, logs = _learns(cfg)
    assert after - before > 0.2, (before, after)
    assert {"timing_s/reward", "timing_s/reward_model", "timing_s/reward_fn"} <= set(logs[-1])


def test_verl_09_layout_and_custom_function_combining_the_score(digit_rm, tiny_model_dir, synth_data_dir, tmp_path):
    """reward.reward_model.* reads the same model; a custom function receives it as rm_score and decides."""
    from polyrl.trainer.ppo import PPOTrainer

    fn = tmp_path / "hybrid.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info, rm_score):\n"
                  "    return {'score': 10.0 + rm_score, 'len': float(len(solution_str))}\n")
    cfg = build_config(PPOConfig(), _grpo(tiny_model_dir, synth_data_dir, tmp_path, "trainer.total_training_steps=1",
                                          "reward.reward_model.enable=True",
                                          f"reward.reward_model.model_path={digit_rm}",
                                          f"custom_reward_function.path={fn}"))
    trainer = PPOTrainer(cfg)
    m = trainer.step()
    assert m["critic/score/mean"] == pytest.approx(10.0 + m["reward_extra/rm_score/mean"], abs=1e-4)
    assert "reward_extra/len/mean" in m


def test_scores_do_not_depend_on_batching(digit_rm):
    """Token-budget forwards (right padding, last real token) give the scores of one-row forwards."""
    from polyrl.rewards.reward_model import DiscriminativeRM

    rng = random.Random(1)
    chats, resp = task_chats(12, seed=5), [random_response(rng) for _ in range(12)]
    cpu = torch.device("cpu")
    one = DiscriminativeRM.load(str(digit_rm), key="k", device=cpu, dtype=torch.float32, max_tokens=None, max_rows=1)
    budget = DiscriminativeRM.load(str(digit_rm), key="k", device=cpu, dtype=torch.float32, max_tokens=120, max_rows=64)
    torch.testing.assert_close(torch.tensor(budget.score(chats, resp)), torch.tensor(one.score(chats, resp)),
                               rtol=0, atol=1e-5)


def test_ppo_with_a_critic_and_a_reward_model(digit_rm, tiny_model_dir, synth_data_dir, tmp_path):
    """Classic RLHF: GAE over a value model's estimates, rewards from the RM alone; the policy learns what the RM
    prefers (its score, critic/score/mean, rose 0.21 -> 0.92 over the 8 steps when written)."""
    cfg = build_config(PPOConfig(), _grpo(tiny_model_dir, synth_data_dir, tmp_path, "trainer.total_training_steps=8",
                                          "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=128",
                                          "critic.optim.lr=1e-2", "reward_model.enable=True",
                                          f"reward_model.model.path={digit_rm}"))
    before, after, logs = _learns(cfg)
    assert after - before > 0.2, (before, after)
    for k in ("critic/vf_loss", "critic/vf_explained_var", "timing_s/reward_model", "timing_s/update_critic"):
        assert k in logs[-1], k


# ------------------------------------------------------------------------------------------------ generative judge
@pytest.fixture(scope="module")
def digit_judge(tmp_path_factory, single_thread):
    """A tiny causal LM trained to answer '1' when the response holds a digit, else '0' (models/tiny_reward.py)."""
    return train_digit_judge(tmp_path_factory.mktemp("judge") / "judge_lm")


def _judge_keys(judge_dir, judge_file) -> list[str]:
    return ["reward_model.enable=True", f"reward_model.model.path={judge_dir}", f"reward_model.judge.path={judge_file}",
            "reward_model.rollout.do_sample=False", "reward_model.rollout.response_length=2",
            "reward_model.rollout.prompt_length=96", "reward_model.rollout.max_num_seqs=128"]


def test_grpo_learns_what_a_trained_generative_judge_prefers(digit_judge, tiny_model_dir, synth_data_dir, tmp_path):
    judge_dir, judge_file = digit_judge
    cfg = build_config(PPOConfig(), _grpo(tiny_model_dir, synth_data_dir, tmp_path, "trainer.total_training_steps=8",
                                          *_judge_keys(judge_dir, judge_file)))
    before, after, logs = _learns(cfg)
    assert after - before > 0.2, (before, after)
    assert logs[-1]["reward/judge_parse_failures"] <= 2  # the trained judge answers 0 or 1
    assert "timing_s/reward_model" in logs[-1]


def test_unparseable_judge_answers_score_the_default_and_are_counted(digit_judge, tiny_model_dir, synth_data_dir,
                                                                     tmp_path):
    from polyrl.trainer.ppo import PPOTrainer

    judge_dir, _ = digit_judge
    never = tmp_path / "never.py"
    never.write_text("JUDGE_TEMPLATE = '{response}'\n\ndef parse_score(answer):\n    raise ValueError('no')\n")
    cfg = build_config(PPOConfig(), _grpo(tiny_model_dir, synth_data_dir, tmp_path, "trainer.total_training_steps=1",
                                          *_judge_keys(judge_dir, never), "reward_model.judge.default_score=-0.5"))
    m = PPOTrainer(cfg).step()
    assert m["reward/judge_parse_failures"] == 16 * 8
    assert m["critic/score/mean"] == pytest.approx(-0.5)


# ------------------------------------------------------------------------------------------------ bad input
def test_missing_reward_model_directory_is_one_sentence(tiny_model_dir, synth_data_dir, tmp_path):
    from polyrl.trainer.ppo import PPOTrainer

    cfg = build_config(PPOConfig(), _grpo(tiny_model_dir, synth_data_dir, tmp_path, "reward_model.enable=True",
                                          f"reward_model.model.path={tmp_path / 'nope'}"))
    with pytest.raises(ConfigError, match="nope.*does not exist"):
        PPOTrainer(cfg)


def test_a_model_without_classification_head_is_refused(tiny_model_dir, synth_data_dir, tmp_path):
    from polyrl.trainer.ppo import PPOTrainer

    cfg = build_config(PPOConfig(), _grpo(tiny_model_dir, synth_data_dir, tmp_path, "reward_model.enable=True",
                                          f"reward_model.model.path={tiny_model_dir}"))
    with pytest.raises(ConfigError, match="not a \\*ForSequenceClassification"):
        PPOTrainer(cfg)


def test_a_judge_template_without_the_response_is_refused(tiny_model_dir, synth_data_dir, tmp_path):
    from polyrl.trainer.ppo import PPOTrainer

    bad = tmp_path / "judge.py"
    bad.write_text("JUDGE_TEMPLATE = 'Rate the answer to {question}'\n\ndef parse_score(a):\n    return 1.0\n")
    cfg = build_config(PPOConfig(), _grpo(tiny_model_dir, synth_data_dir, tmp_path, "reward_model.enable=True",
                                          f"reward_model.model.path={tiny_model_dir}",
                                          f"reward_model.judge.path={bad}"))
    with pytest.raises(ConfigError, match="no \\{response\\} placeholder"):
        PPOTrainer(cfg)


@pytest.mark.parametrize("keys,match", [
    (["reward.reward_model.enable=True", "reward_model.enable=True"], "both of verl's layouts"),
    (["reward_model.model.path=/x"], "reward_model.enable=False"),
    (["reward_model.enable=True", "reward_model.model.path=/x", "reward_model.rollout.temperature=0.5"],
     "configures a generative judge"),
    (["reward_model.enable=True", "reward_model.model.path=/x", "reward_model.rollout.name=vllm"], "native"),
    (["reward_model.enable=True", "reward_model.model.path=/x", "reward_model.launch_reward_fn_async=True"],
     "enable_resource_pool=True"),
])
def test_reward_model_keys_refused_with_one_sentence(keys, match):
    from polyrl.rewards.model_reward import resolve_reward_model

    with pytest.raises(UserError, match=match):
        resolve_reward_model(build_config(PPOConfig(), keys))


@pytest.mark.slow  # ~15 s idle, 35 s on a busy 2-core box: two torchrun processes start and import torch
def test_sharded_reward_model_matches_one_process(digit_rm, tmp_path):
    """2 processes, the RM FSDP2-sharded like the reference: ranks with unequal forward counts (padding passes) get
    the scores one unsharded process gives."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from polyrl.distributed.launch import torchrun_command
    from polyrl.rewards.reward_model import DiscriminativeRM

    rng = random.Random(3)
    rows = [(c, random_response(rng)) for c in task_chats(9, seed=6)]
    (tmp_path / "chats.json").write_text(json.dumps(rows))
    job = Path(__file__).with_name("reward_model_shard_job.py")
    env = {**os.environ, "PYTHONPATH": str(Path.cwd()), "OMP_NUM_THREADS": "1"}
    subprocess.run(torchrun_command(2, [str(job), str(digit_rm), str(tmp_path)]), check=True, env=env, timeout=300)
    one = DiscriminativeRM.load(str(digit_rm), key="k", device=torch.device("cpu"), dtype=torch.float32,
                                max_tokens=None, max_rows=1)
    want = one.score([c for c, _ in rows], [r for _, r in rows])
    got0, got1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    torch.testing.assert_close(torch.tensor(got0), torch.tensor(want), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got1), torch.tensor(want[:2]), rtol=0, atol=1e-5)


def test_reward_gpus_without_ray_are_the_ones_after_the_training_processes(monkeypatch):
    from polyrl.rewards.remote import local_reward_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # e.g. the off-policy pipeline's trainer and rollout processes
    for rank, gpus in ((0, ["6"]), (1, ["7"])):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert local_reward_gpus(2, "k") == gpus
    assert local_reward_gpus(1, "k") == ["6"]  # fewer reward GPUs than ranks: shared
    assert local_reward_gpus(0, "k") == []  # the CPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert local_reward_gpus(2, "k") == ["5", "6"]
    with pytest.raises(ConfigError, match="reward.reward_model.n_gpus_per_node=8 .* set it to at most 3"):
        local_reward_gpus(8, "reward.reward_model.n_gpus_per_node")


def test_a_reward_process_without_ray_scores_as_here_and_reports_errors():
    """`ProcessReward` (a spawned process, the no-Ray pool): answers in ticket order whatever order they are asked
    in, and the reward's own exceptions come back as one sentence instead of a hang."""
    from polyrl.errors import RewardError
    from polyrl.rewards.config import CustomRewardConfig, OverlongBufferConfig
    from polyrl.rewards.remote import ProcessReward, manager_score

    args = (CustomRewardConfig(), OverlongBufferConfig(enable=True, len=4), 8)
    samples = [("polyrl/reverse", "cba", "cba", {}), ("polyrl/reverse", "abc", "cba", {})]
    here = manager_score(*args)
    worker = ProcessReward(manager_score, args, gpus=[])
    try:
        a, b = worker.submit(samples, [3, 8]), worker.submit(samples[:1], [7])
        assert worker.get([b, a]) == [here(samples[:1], [7]), here(samples, [3, 8])]
        with pytest.raises(RewardError, match="overlong_buffer needs one response length per sample"):
            worker.get(worker.submit(samples, [3]))
    finally:
        worker.close()
    broken = ProcessReward(int, ("x",), gpus=[])
    with pytest.raises(RewardError, match="building the reward raised ValueError"):
        broken.get(broken.submit())
    broken.close()


@pytest.mark.slow  # ~20-40 s: a local Ray starts and its worker imports torch and transformers
def test_reward_model_on_a_resource_pool_of_its_own(digit_rm, tiny_model_dir, synth_data_dir, tmp_path):
    """enable_resource_pool: the classifier loads and scores in a Ray actor (CPU here, its own GPUs on a GPU
    cluster); the scores and the model/manager timings come back to the trainer."""
    ray = pytest.importorskip("ray")
    from polyrl.distributed.ray_cluster import init_ray
    from polyrl.rewards.model_reward import RemoteModelReward
    from polyrl.trainer.ppo import PPOTrainer

    init_ray(num_cpus=4)
    try:
        cfg = build_config(PPOConfig(), _grpo(tiny_model_dir, synth_data_dir, tmp_path,
                                              "trainer.total_training_steps=1", "reward.reward_model.enable=True",
                                              f"reward.reward_model.model_path={digit_rm}",
                                              "reward.reward_model.enable_resource_pool=True",
                                              "reward.reward_model.n_gpus_per_node=0"))
        trainer = PPOTrainer(cfg)
        assert isinstance(trainer.reward, RemoteModelReward)
        m = trainer.step()
        assert 0.0 < m["timing_s/reward_model"] <= m["timing_s/reward"]
        assert -0.5 < m["critic/score/mean"] < 1.5
    finally:
        ray.shutdown()


def test_the_policy_itself_as_judge(tiny_model_dir, synth_data_dir, tmp_path):
    """The judge may be the policy's own directory (a frozen copy of the initial policy) on the same engine."""
    from polyrl.trainer.ppo import PPOTrainer

    judge = tmp_path / "length_judge.py"
    judge.write_text("JUDGE_TEMPLATE = 'Reference {reference}. Question {question}. Answer {response}.'\n\n"
                     "def parse_score(answer):\n    return len(answer) / 3.0\n")
    cfg = build_config(PPOConfig(), _grpo(tiny_model_dir, synth_data_dir, tmp_path, "trainer.total_training_steps=1",
                                          "reward_model.enable=True", f"reward_model.model.path={tiny_model_dir}",
                                          f"reward_model.judge.path={judge}", "reward_model.rollout.response_length=3",
                                          "reward_model.rollout.prompt_length=100"))
    trainer = PPOTrainer(cfg)
    assert trainer.reward.scorer.engine is not trainer.engine
    m = trainer.step()
    assert m["reward/judge_parse_failures"] == 0 and 0.0 < m["critic/score/mean"] <= 1.0
