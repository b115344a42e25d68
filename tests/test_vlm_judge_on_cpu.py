"""FlowGRPO's VLM judge (rewards/vlm_judge.py) on CPU, with a tiny Qwen2-VL the test trains (models/tiny_reward.py)
to answer 1 for bright images and 0 for dark ones, reached through the flow trainer's reward construction
(trainer/flow_cli.build_flow_reward) and the same judge keys as the text judge."""

from __future__ import annotations

import pytest
import torch

from polyrl.config import build_config
from polyrl.errors import ConfigError
from polyrl.models.tiny_reward import grey_images, train_brightness_judge
from polyrl.trainer.flow_config import FlowConfig
from test_flow_pipeline_on_cpu import pipe_dir  # noqa: F401  (a fixture: the tiny Qwen-Image pipeline)


@pytest.fixture(scope="module")
def brightness_judge(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_brightness_judge(tmp_path_factory.mktemp("vlm") / "judge_vlm")
    finally:
        torch.set_num_threads(n)


def _keys(model_dir, judge_file, *extra) -> list[str]:
    return ["reward.reward_model.enable=True", f"reward.reward_model.model_path={model_dir}",
            f"reward.reward_model.judge.path={judge_file}", "reward.reward_model.rollout.do_sample=False",
            "reward.reward_model.rollout.response_length=2", "reward.reward_model.rollout.max_num_seqs=16", *extra]


def test_the_vlm_judge_scores_images_in_the_flow_reward(brightness_judge):
    from polyrl.trainer.flow_cli import build_flow_reward

    cfg = build_config(FlowConfig(), _keys(*brightness_judge))
    reward_fn, scorer = build_flow_reward(cfg.reward)
    assert scorer is None and list(reward_fn.fns) == ["reward_model"]  # the judge alone, not the default ocr
    b = torch.rand(40, generator=torch.Generator().manual_seed(7))
    scores = reward_fn(grey_images(b, seed=99), ["square"] * 40, [{}] * 40)
    accuracy = ((scores == 1.0) == (b > 0.5)).float().mean()
    assert accuracy >= 0.85, (accuracy, scores, b)  # it looks at the image: 0.97 when written
    assert reward_fn.last_components["reward/judge_parse_failures"] == 0.0


def test_unparseable_answers_score_the_default_and_are_counted(brightness_judge, tmp_path):
    from polyrl.trainer.flow_cli import build_flow_reward

    never = tmp_path / "never.py"
    never.write_text("JUDGE_TEMPLATE = 'Rate {question}: {response}'\n\ndef parse_score(answer):\n    return None\n")
    cfg = build_config(FlowConfig(), _keys(brightness_judge[0], never, "reward.reward_model.judge.default_score=-0.5",
                                           "reward.reward_fns={reward_model: 2.0}"))
    reward_fn, _ = build_flow_reward(cfg.reward)
    scores = reward_fn(grey_images(torch.rand(5)), ["a"] * 5, [{}] * 5)
    assert scores.tolist() == [-1.0] * 5  # the default, weighted 2
    assert reward_fn.last_components["reward/judge_parse_failures"] == 5.0


@pytest.mark.parametrize("keys,match", [
    (["reward.reward_model.enable=True", "reward.reward_model.model_path=/x"], "needs reward.reward_model.judge.path"),
    (["reward.reward_model.judge.path=/x.py"], "reward.reward_model.enable=False"),
    (["reward.reward_model.rollout.gpu_memory_utilization=0.3"], "HF generate"),
])
def test_vlm_judge_keys_refused_with_one_sentence(keys, match):
    from polyrl.trainer.checks import check_flow_supported

    with pytest.raises(ConfigError, match=match):
        check_flow_supported(build_config(FlowConfig(), keys))


def test_a_text_model_or_a_template_without_the_image_is_refused(brightness_judge, tiny_model_dir, tmp_path):
    from polyrl.trainer.flow_cli import build_flow_reward

    with pytest.raises(ConfigError, match="not a vision-language model"):
        build_flow_reward(build_config(FlowConfig(), _keys(tiny_model_dir, brightness_judge[1])).reward)
    bad = tmp_path / "judge.py"
    bad.write_text("JUDGE_TEMPLATE = 'Is {question} bright?'\n\ndef parse_score(a):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="no \\{response\\} placeholder"):
        build_flow_reward(build_config(FlowConfig(), _keys(brightness_judge[0], bad)).reward)


def test_a_flow_grpo_step_scores_its_images_with_the_vlm_judge(brightness_judge, pipe_dir):
    """The judge as the reward of a FlowGRPO step on a tiny Qwen-Image pipeline (tests/test_flow_pipeline_on_cpu.py's):
    the generated 32x32 images go through the image processor, and every score is a parsed verdict, 0 or 1."""
    from test_flow_pipeline_on_cpu import _config

    from polyrl.models.diffusion.pipeline import load_pipeline_policy
    from polyrl.trainer.flow_cli import build_flow_reward
    from polyrl.trainer.flow_grpo import FlowGRPOTrainer

    torch.manual_seed(0)
    cfg = _config(1.0, True, False)
    cfg.reward = build_config(FlowConfig(), _keys(*brightness_judge)).reward
    reward_fn, _ = build_flow_reward(cfg.reward)
    p = cfg.actor_rollout_ref.rollout.pipeline
    policy = load_pipeline_policy(pipe_dir, height=p.height, width=p.width,
                                  max_sequence_length=p.max_sequence_length)
    policy.add_lora(4, 8, cfg.actor_rollout_ref.model.target_modules)
    prompts = [("a square", {}), ("a card", {})]
    m = FlowGRPOTrainer(cfg, policy, reward_fn, prompts, prompts[:1]).step()
    assert m["critic/rewards/min"] in (0.0, 1.0) and m["critic/rewards/max"] in (0.0, 1.0)
    assert m["reward/judge_parse_failures"] == 0.0 and m["reward/reward_model"] == m["critic/rewards/mean"]
