"""`fit` leaves what lives after the first step out of later garbage collections (trainer/core.py freeze_heap) and
gives it back to the collector when the run ends."""

import gc
import tempfile

import torch

from polyrl.models.diffusion import tiny
from polyrl.trainer import flow_quickstart
from polyrl.trainer.flow_config import FlowConfig
from polyrl.trainer.flow_grpo import FlowGRPOTrainer


def test_the_heap_is_frozen_after_the_first_step_and_unfrozen_after_the_run():
    cfg = FlowConfig()
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    ro.n, ro.pipeline.num_inference_steps, ro.val_kwargs.num_inference_steps = 2, 3, 2
    ro.algo.sde_window_size, ro.algo.sde_window_range = 1, [0, 2]
    cfg.data.train_batch_size, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu = 2, 2, 4
    t = cfg.trainer
    t.total_training_steps, t.test_freq, t.save_freq, t.progress_bar, t.logger = 3, 0, 0, False, []
    run = tempfile.mkdtemp(prefix="polyrl-test-gc-")
    t.run_dir, t.default_local_dir = run, f"{run}/checkpoints"
    torch.manual_seed(0)
    policy = flow_quickstart.make_policy(cfg, tiny.build_transformer(seed=0), tiny.CharPromptEncoder(seed=0))
    prompts = [(tiny.prompt_for(d), {"digit": d}) for d in range(4)]
    trainer = FlowGRPOTrainer(cfg, policy, lambda im, p, m: im.float().mean(dim=(1, 2, 3)), prompts, prompts[:2])
    frozen, step = [], trainer.step
    trainer.step = lambda: frozen.append(gc.get_freeze_count()) or step()
    gc.unfreeze()
    trainer.fit()
    assert frozen[0] == 0 and all(n > 1000 for n in frozen[1:]), frozen  # the model, graphs, optimizer...
    assert gc.get_freeze_count() == 0
