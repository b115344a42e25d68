"""Reward models on a GPU: bf16 scoring, the colocated sleep (weights off the GPU between calls), and GRPO runs with a
classifier and with a judge on CUDA. The tiny models are the CPU tests' (models/tiny_reward.py)."""

import random

import pytest
import torch

from polyrl.models.tiny_reward import random_response, task_chats, train_digit_classifier, train_digit_judge

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def digit_rm(tmp_path_factory):
    return train_digit_classifier(tmp_path_factory.mktemp("rm") / "digit_rm")


@pytest.fixture(scope="module")
def digit_judge(tmp_path_factory):
    return train_digit_judge(tmp_path_factory.mktemp("judge") / "judge_lm")


def test_bf16_scores_match_fp32_and_the_weights_sleep_between_calls(digit_rm):
    from polyrl.rewards.reward_model import DiscriminativeRM

    rng = random.Random(0)
    chats, resp = task_chats(32, seed=1), [random_response(rng) for _ in range(32)]
    cpu = DiscriminativeRM.load(str(digit_rm), key="k", dtype=torch.float32, device=torch.device("cpu"),
                                max_tokens=None, max_rows=64)
    gpu = DiscriminativeRM.load(str(digit_rm), key="k", dtype=torch.bfloat16, device=torch.device("cuda"),
                                max_tokens=256, max_rows=64, sleep=True)
    assert next(gpu.model.parameters()).device.type == "cpu"  # asleep until score runs
    torch.testing.assert_close(torch.tensor(gpu.score(chats, resp)), torch.tensor(cpu.score(chats, resp)),
                               atol=0.05, rtol=0.05)
    assert next(gpu.model.parameters()).device.type == "cpu"  # and asleep again after


def _cfg(model_dir, data_dir, tmp_path, *extra):
    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig

    return build_config(PPOConfig(), [
        f"data.train_files={data_dir / 'train.parquet'}", "data.train_batch_size=16", "data.max_prompt_length=32",
        "data.max_response_length=6", f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.actor.optim.lr=2e-2", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.rollout.n=8", "trainer.logger=[file]", f"trainer.run_dir={tmp_path / 'run'}",
        f"trainer.default_local_dir={tmp_path / 'ck'}", "trainer.progress_bar=False", "trainer.val_before_train=False",
        "trainer.resume_mode=disable", "trainer.device=cuda", "trainer.total_training_steps=2", *extra])


def test_grpo_with_a_reward_model_and_with_a_judge_on_cuda(digit_rm, digit_judge, tiny_model_dir, synth_data_dir,
                                                           tmp_path):
    from polyrl.trainer.ppo import PPOTrainer

    judge_dir, judge_file = digit_judge
    for name, keys in {
        "classifier": ["reward_model.enable=True", f"reward_model.model.path={digit_rm}"],
        "judge": ["reward_model.enable=True", f"reward_model.model.path={judge_dir}",
                  f"reward_model.judge.path={judge_file}", "reward_model.rollout.do_sample=False",
                  "reward_model.rollout.response_length=2", "reward_model.rollout.prompt_length=96"],
    }.items():
        trainer = PPOTrainer(_cfg(tiny_model_dir, synth_data_dir, tmp_path / name, *keys))
        m = trainer.step()
        assert m["timing_s/reward_model"] > 0 and 0.0 <= m["critic/score/mean"] <= 1.05, (name, m)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: the trainer's and the reward model's")
def test_a_reward_model_on_a_gpu_of_its_own_without_ray(digit_rm, tiny_model_dir, synth_data_dir, tmp_path):
    """enable_resource_pool on one host without Ray: the model runs in a process spawned on GPU 1 (the one after the
    trainer's), which holds memory there while the trainer computes on GPU 0."""
    from polyrl.rewards.remote import ProcessReward
    from polyrl.trainer.ppo import PPOTrainer

    free_before = torch.cuda.mem_get_info(1)[0]
    trainer = PPOTrainer(_cfg(tiny_model_dir, synth_data_dir, tmp_path, "reward_model.enable=True",
                              f"reward_model.model.path={digit_rm}", "reward_model.enable_resource_pool=True",
                              "reward_model.n_gpus_per_node=1"))
    assert isinstance(trainer.reward.client, ProcessReward) and trainer.reward.client.gpus == ["1"]
    m = trainer.step()
    assert m["timing_s/reward_model"] > 0 and m["timing_s/reward"] >= m["timing_s/reward_model"]
    assert free_before - torch.cuda.mem_get_info(1)[0] > 100 * 2**20  # the worker's context and model on GPU 1
    trainer.reward.close()


def test_the_vlm_judge_in_bf16_on_cuda_agrees_with_cpu(tmp_path):
    from polyrl.models.tiny_reward import grey_images, train_brightness_judge
    from polyrl.rewards.config import JudgeConfig, RewardModelRolloutConfig
    from polyrl.rewards.vlm_judge import VLMJudge, VLMJudgeSpec

    model_dir, judge_file = train_brightness_judge(tmp_path / "vlm")
    spec = VLMJudgeSpec(str(model_dir), "k.model_path", JudgeConfig(path=str(judge_file)),
                        RewardModelRolloutConfig(do_sample=False, response_length=2, max_num_seqs=16))
    images = grey_images(torch.rand(32, generator=torch.Generator().manual_seed(3)), seed=5)
    cpu = VLMJudge(spec, device=torch.device("cpu"))(images, ["square"] * 32, [{}] * 32)
    gpu_judge = VLMJudge(spec, device=torch.device("cuda"))
    gpu = gpu_judge(images, ["square"] * 32, [{}] * 32)
    assert next(gpu_judge.model.parameters()).device.type == "cpu"  # asleep between calls (free_cache_engine)
    assert sum(a == b for a, b in zip(cpu, gpu)) >= 30, (cpu, gpu)
