"""A real CUDA out-of-memory error in the update (no injection): the guard frees, halves the token budget, retries.

The process is capped with `torch.cuda.set_per_process_memory_fraction` just above what one micro-batch of a quarter
of the budget needs (measured in the test), so the full budget fails for real in the caching allocator.
"""

import copy

import pytest
import torch

from polyrl.algorithms.losses import LossKnobs
from polyrl.trainer.config import PPOConfig
from polyrl.trainer.oom import OOMGuard, StageContext
from polyrl.learner.actor import Actor, ForwardSettings, UpdateSettings, make_scheduler
from polyrl.learner.batch import build_batch

pytestmark = pytest.mark.gpu


def _model():
    from transformers import AutoModelForCausalLM

    from polyrl.models.tiny import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(32000, arch="qwen2", hidden_size=512, layers=8, heads=8, kv_heads=2, intermediate=2048,
                      max_position_embeddings=4096, tie=False)
    return AutoModelForCausalLM.from_config(cfg).cuda()


def _update(model, batch, budget, guard_cfg=None, logs=None):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    actor = Actor(model, opt, make_scheduler(opt, total_steps=2, warmup_steps=0, kind="constant", min_lr_ratio=0.0,
                                             num_cycles=0.5), fwd=ForwardSettings())
    s = lambda: UpdateSettings(  # noqa: E731
        mini_batch_size=64, micro_batch_size=64, ppo_epochs=1, temperature=1.0, loss_mode="vanilla",
        loss_agg_mode="token-mean", knobs=LossKnobs(), grad_clip=1e9, entropy_coeff=0.0, use_kl_loss=False,
        kl_loss_coef=0.0, kl_loss_type="low_var_kl", old_from_current=True,
        max_token_len=guard_cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu if guard_cfg else budget)
    if guard_cfg is None:
        return actor.update(batch, s())
    guard = OOMGuard(guard_cfg, optimizers=[opt], log=logs.append)
    guard.run("update_actor", lambda: actor.update(batch, s()), ctx=StageContext(batch, 64, model=model))
    return guard


def test_real_cuda_oom_in_update_halves_the_budget_and_completes():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 30000, (64,), generator=g).tolist() for _ in range(64)]
    responses = [torch.randint(10, 30000, (448,), generator=g).tolist() for _ in range(64)]
    batch = build_batch(prompts, responses, pad_token_id=0, device=torch.device("cuda"))
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g).cuda() * batch["response_mask"]
    batch["rollout_log_probs"] = torch.zeros_like(batch["advantages"])
    base = _model()
    quarter = 8192
    model = copy.deepcopy(base)
    _update(model, batch, quarter)  # warm-up (kernels, allocator), then measure one quarter-budget update
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _update(model, batch, quarter)
    need = torch.cuda.max_memory_allocated() - baseline
    del model
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    cfg = PPOConfig()
    cfg.actor_rollout_ref.actor.use_dynamic_bsz, cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = True, 4 * quarter
    cfg.actor_rollout_ref.model.enable_gradient_checkpointing = True  # so the shrinker only halves the budget
    model = copy.deepcopy(base)
    torch.cuda.synchronize()
    grads = sum(p.numel() * p.element_size() for p in model.parameters())  # measured above as part of the baseline
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + grads + 1.6 * need) / total)
    logs = []
    try:
        guard = _update(model, batch, None, guard_cfg=cfg, logs=logs)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert guard.num_retries >= 1, "the full budget should not fit under the cap"
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu <= 2 * quarter
    assert len(logs) == 1 and "ppo_max_token_len_per_gpu" in logs[0] and "out of memory" in logs[0].lower()
