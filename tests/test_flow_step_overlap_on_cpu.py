"""Where a FlowGRPO step's time went besides the GPU's work. With an async reward scorer, the update's first trained
forward is launched before the last chunk's rewards are waited for (the GPU computes while the CPU waits), and the
update is the same bits as scoring first: with skip_zero_adv the first micro-batch is a guess, dropped when the rewards
filter it differently. And the text encoder runs without cuDNN attention (a plan built per new prompt length)."""

import tempfile

import pytest
import torch

from polyrl.models.diffusion import tiny
from polyrl.trainer import flow_quickstart
from polyrl.trainer.flow_config import FlowConfig
from polyrl.trainer.flow_grpo import FlowGRPOTrainer

N = 2  # images per prompt: the first group is the batch's first N images


def _scores(images, offset: int, zero_first_group: bool) -> torch.Tensor:
    scores = images.float().mean(dim=(1, 2, 3))
    if zero_first_group:  # one zero-std group at the front of the batch
        scores[: max(0, N - offset)] = 0.0
    return scores


class InProcessScorer:
    """The async scorer's interface (submit / collect), scoring in the caller; `collect` logs when it is called."""

    def __init__(self, log: list[str], zero_first_group: bool):
        self.log, self.zero_first_group, self.parts = log, zero_first_group, {}

    def submit(self, offset, images, prompts, metadata):
        self.parts[offset] = _scores(images, offset, self.zero_first_group)

    def collect(self, batch):
        self.log.append("collect")
        out, self.parts = torch.cat([self.parts[k] for k in sorted(self.parts)]), {}
        assert out.numel() == batch
        return out


def _run(async_reward: bool, skip_zero_adv: bool, zero_first_group: bool):
    cfg = FlowConfig()
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    ro.n, ro.pipeline.num_inference_steps = N, 4
    ro.algo.sde_window_size, ro.algo.sde_window_range = 2, [0, 3]
    cfg.data.train_batch_size, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu = 2, 2, 2
    actor.optim.lr, actor.diffusion_loss.clip_ratio, actor.skip_zero_adv = 1e-3, 0.5, skip_zero_adv
    cfg.actor_rollout_ref.model.lora_rank, cfg.actor_rollout_ref.model.lora_alpha = 4, 8
    cfg.trainer.progress_bar, cfg.trainer.logger = False, []
    run = tempfile.mkdtemp(prefix="polyrl-test-overlap-")
    cfg.trainer.run_dir, cfg.trainer.default_local_dir = run, f"{run}/checkpoints"
    torch.manual_seed(0)
    policy = flow_quickstart.make_policy(cfg, tiny.build_transformer(seed=0), tiny.CharPromptEncoder(seed=0))
    prompts = [(tiny.prompt_for(d), {"digit": d}) for d in range(4)]
    log: list[str] = []
    scorer = InProcessScorer(log, zero_first_group) if async_reward else None
    reward = lambda images, prompts, metadata: _scores(images, 0, zero_first_group)  # noqa: E731
    trainer = FlowGRPOTrainer(cfg, policy, reward, prompts, prompts[:2], async_scorer=scorer)
    forward = trainer._trained_forward

    def logged_forward(*args):
        log.append("forward")
        return forward(*args)

    trainer._trained_forward = logged_forward
    metrics = [trainer.step() for _ in range(2)]
    return [p.detach().clone() for p in policy.trainable_parameters()], metrics, log


@pytest.mark.parametrize("skip_zero_adv,zero_first_group", [(False, False), (True, False), (True, True)])
def test_first_forward_runs_before_the_rewards_are_waited_for_and_changes_nothing(skip_zero_adv, zero_first_group):
    sync_params, sync_metrics, sync_log = _run(False, skip_zero_adv, zero_first_group)
    params, metrics, log = _run(True, skip_zero_adv, zero_first_group)
    for a, b in zip(params, sync_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for m, s in zip(metrics, sync_metrics):
        for key in ("critic/rewards/mean", "critic/advantages/max", "actor/pg_loss", "actor/grad_norm"):
            assert m[key] == s[key], key
    collects = [j for j, e in enumerate(log) if e == "collect"]
    assert len(collects) == 2 and all(log[j - 1] == "forward" for j in collects), log  # a forward, then the wait
    extra = 2 if zero_first_group else 0  # a wrong guess per step: its forward is dropped
    assert log.count("forward") == len(sync_log) + extra


def test_prompts_are_encoded_without_cudnn_attention():
    """cuDNN's SDPA builds a plan per new text length (1.1 s for a 7B encoder on an H200): the text encoder runs
    with the flash / memory-efficient / math backends only (pipeline.TEXT_ATTENTION)."""
    policy = flow_quickstart.make_policy(FlowConfig(), tiny.build_transformer(seed=0), tiny.CharPromptEncoder(seed=0))
    encode, seen = policy.encode_fn, []
    policy.encode_fn = lambda prompts: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or encode(prompts)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    policy.cache_prompts(["draw a 3"])
    assert seen == [False] and torch.backends.cuda.cudnn_sdp_enabled()
