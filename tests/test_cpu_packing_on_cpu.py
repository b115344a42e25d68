"""The CPU's auto choice to pack micro-batches with shared prompts (learner/memory.py: cpu_packs_shared_prompts)."""

import torch

from polyrl.learner.memory import CPU_PACK_MAX_TOKENS, cpu_packs_shared_prompts, resolve_switches
from polyrl.trainer.config import PPOConfig

CPU = torch.device("cpu")


def _cfg(n=8, micro=16, prompt=64, response=32, **actor):
    cfg = PPOConfig()
    cfg.actor_rollout_ref.rollout.n = n
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = micro
    cfg.data.max_prompt_length, cfg.data.max_response_length = prompt, response
    for key, value in actor.items():
        setattr(cfg.actor_rollout_ref.actor, key, value)
    resolve_switches(cfg)
    return cfg


def test_packs_short_micro_batches_of_shared_prompts_and_says_so_once():
    logged = []
    assert cpu_packs_shared_prompts(_cfg(), CPU, log=logged.append)  # 16 x 96 = 1536 tokens
    assert len(logged) == 1 and "at most 1536 tokens" in logged[0] and "8 samples" in logged[0]


def test_stays_padded_where_packing_does_not_pay_or_does_not_fit():
    quiet = lambda _: None  # noqa: E731
    assert not cpu_packs_shared_prompts(_cfg(n=1), CPU, log=quiet)  # nothing shared
    assert not cpu_packs_shared_prompts(_cfg(micro=CPU_PACK_MAX_TOKENS // 96 + 1), CPU, log=quiet)  # O(N^2) mask
    cfg = _cfg()
    cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 64  # the log-prob pass's micro-batch too
    assert not cpu_packs_shared_prompts(cfg, CPU, log=quiet)
    cfg = _cfg()
    cfg.actor_rollout_ref.model.use_shared_prompt = False
    assert not cpu_packs_shared_prompts(cfg, CPU, log=quiet)
    for budget, packs in ((1024, True), (8192, False)):  # token-budget micro-batches: bounded by the budgets
        dynamic = _cfg(micro=None, ppo_max_token_len_per_gpu=budget)
        roles = dynamic.actor_rollout_ref
        assert roles.actor.use_dynamic_bsz and roles.rollout.log_prob_use_dynamic_bsz
        roles.rollout.log_prob_max_token_len_per_gpu = roles.ref.log_prob_max_token_len_per_gpu = 1024
        assert cpu_packs_shared_prompts(dynamic, CPU, log=quiet) == packs
    assert not cpu_packs_shared_prompts(_cfg(), torch.device("meta"), log=quiet)  # CPU only
