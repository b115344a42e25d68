"""Shared prompts in packed rows (packing.py, shared_prefix.py): a GRPO prompt's n samples carry one copy of it, and
log-probs, entropies, gradients and the whole update stay those of the unshared rows."""

import copy

import pytest
import torch

from polyrl.algorithms.losses import LossKnobs
from polyrl.models.loader import load_causal_lm
from polyrl.learner.actor import (Actor, ForwardSettings, UpdateSettings, logprobs_and_entropy, make_scheduler,
                                   micro_batches)
from polyrl.learner.batch import build_batch
from polyrl.learner.dynamic_batch import shared_prompt_items
from polyrl.learner.flops import training_flops
from polyrl.learner.packing import pack, trunk_work

TOL = dict(rtol=0, atol=2e-5)  # fp32: shared and unshared differ only in summation order


def _grpo_batch(n_per_prompt=(4, 1, 3), seed=0):
    """Rows prompt-major like a GRPO rollout; prompt 1 has a single sample (nothing to share)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    prompts, responses = [], []
    for n in n_per_prompt:
        p = torch.randint(4, 90, (rand(2, 12),), generator=g).tolist()
        for _ in range(n):
            prompts.append(p)
            responses.append(torch.randint(4, 90, (rand(1, 10),), generator=g).tolist())
    batch = build_batch(prompts, responses, pad_token_id=0, device=torch.device("cpu"))
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]
    return batch, prompts, responses


def test_shared_layout_holds_each_prompt_once_and_predicts_from_the_same_tokens():
    batch, prompts, responses = _grpo_batch()
    plain, shared = pack(batch), pack(batch, share_prompts=True)
    distinct = [prompts[0], prompts[4], prompts[5]]
    assert shared.num_tokens == sum(map(len, distinct)) + sum(map(len, responses)) < plain.num_tokens
    sh = shared.shared
    assert sh.num_prompt == sum(map(len, distinct))
    ids, cu = shared.input_ids[0].tolist(), shared.cu_seqlens.tolist()
    assert len(cu) == 1 + len(distinct) + len(responses)
    seen = []
    for s in range(len(cu) - 1):  # each query segment and the rows it attends to
        kv = [ids[i] for i in sh.kv_index[sh.cu_kv[s]:sh.cu_kv[s + 1]].tolist()]
        own = ids[cu[s]:cu[s + 1]]
        if s < len(distinct):  # a prompt attends to itself
            assert cu[s + 1] <= sh.num_prompt and kv == own and own in distinct
        else:  # a response: its prompt, then itself
            assert cu[s] >= sh.num_prompt and kv[len(kv) - len(own):] == own
            seen.append((tuple(kv[:len(kv) - len(own)]), tuple(own)))
    assert sorted(seen) == sorted(zip(map(tuple, prompts), map(tuple, responses)))
    # every target is predicted from the same token at the same position as without sharing
    assert torch.equal(shared.targets, plain.targets) and torch.equal(shared.rows, plain.rows)
    for key in ("input_ids", "position_ids"):
        assert torch.equal(getattr(shared, key)[0, shared.pred_index], getattr(plain, key)[0, plain.pred_index])
    assert pack({k: v[3:6] for k, v in batch.items()}, share_prompts=True).shared is None  # no prompt repeats


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_prompts_give_the_same_logprobs_entropy_and_gradients(tiny_model_dir, tiny_qwen2, arch):
    base = load_causal_lm(str(tiny_model_dir)) if arch == "llama" else tiny_qwen2
    batch, _, _ = _grpo_batch(seed=1)
    results = []
    for share in (False, True):
        model = copy.deepcopy(base)
        fwd = ForwardSettings(pack_on_cpu=True, share_prompts=share, logprob_chunk_size=7)
        logp, ent = logprobs_and_entropy(model, batch, 0.8, True, fwd)
        ((logp * batch["advantages"]).sum() + 0.1 * ent.sum()).backward()
        results.append((logp.detach(), ent.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (lp0, e0, g0), (lp1, e1, g1) = results
    assert g0.abs().max() > 1e-3
    torch.testing.assert_close(lp1, lp0, **TOL)
    torch.testing.assert_close(e1, e0, **TOL)
    torch.testing.assert_close(g1, g0, rtol=0, atol=1e-5)


def test_shared_prompt_items_keep_groups_together_and_split_what_does_not_fit():
    # group 0: prompt 10, responses 30, 20, 25; group 1: prompt 5, response 40; budget 60
    items, costs = shared_prompt_items([0, 0, 0, 1], [10, 10, 10, 5], [30, 20, 25, 40], 60)
    # longest first: 10+30+25 > 60, so row 0 goes alone and rows 2, 1 share a second copy of the prompt
    assert sorted(map(sorted, items)) == [[0], [1, 2], [3]]
    by_rows = {tuple(i): c for i, c in zip(items, costs)}
    assert by_rows[(0,)] == 10 + 30 and by_rows[(1, 2)] == 10 + 25 + 20 and by_rows[(3,)] == 5 + 40


def test_token_budget_micro_batches_with_shared_prompts_give_the_same_update(tiny_model_dir):
    base = load_causal_lm(str(tiny_model_dir))
    batch, prompts, responses = _grpo_batch((4, 2, 3, 3), seed=3)
    batch["ref_log_probs"] = torch.zeros_like(batch["advantages"]) - 3.0
    budget = max(len(p) + len(r) for p, r in zip(prompts, responses)) * 3
    groups = micro_batches(batch, 12, budget, share_prompts=True)
    assert len(groups) > 1 and sorted(int(r) for g in groups for r in g) == list(range(12))
    for g in groups:
        rows = g.tolist()
        distinct = {tuple(prompts[r]) for r in rows}
        assert sum(map(len, distinct)) + sum(len(responses[r]) for r in rows) <= budget
    results = []
    for share in (False, True):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        actor = Actor(model, opt, make_scheduler(opt, total_steps=1, warmup_steps=0, kind="constant",
                                                 min_lr_ratio=0.0, num_cycles=0.5),
                      fwd=ForwardSettings(pack_on_cpu=True, share_prompts=share))
        s = UpdateSettings(mini_batch_size=12, micro_batch_size=12, ppo_epochs=1, temperature=1.0,
                           loss_mode="vanilla", loss_agg_mode="token-mean", knobs=LossKnobs(), grad_clip=1e9,
                           entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
                           old_from_current=True, max_token_len=budget)
        actor.update(batch, s)
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert (results[0] - torch.cat([p.flatten() for p in base.parameters()])).abs().max() > 1e-4
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-6)


def test_trunk_work_counts_a_shared_prompt_once():
    batch, prompts, responses = _grpo_batch((3, 1))
    seqlens, pairs = trunk_work(batch, share_prompts=True)
    p0, p1 = len(prompts[0]), len(prompts[3])
    r = [len(x) for x in responses]
    assert sorted(seqlens) == sorted([p0, p1] + r)
    assert pairs == p0 ** 2 + p1 ** 2 + sum(x * x + 2 * len(p) * x for p, x in zip(prompts, r))
    plain_lens, plain_pairs = trunk_work(batch, share_prompts=False)
    assert plain_lens == [len(p) + x for p, x in zip(prompts, r)] and plain_pairs == sum(s * s for s in plain_lens)
    cfg = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
               intermediate_size=16, vocab_size=10)
    saved = training_flops(cfg, plain_lens, 0) - training_flops(cfg, seqlens, 0, attn_pairs=pairs)
    trunk = 8 * (8 + 8 + 8) + 8 * 8 + 3 * 8 * 16  # q, k, v, o and the MLP, per token
    assert saved == pytest.approx(6 * trunk * 2 * p0 + 12 * 8 * (plain_pairs - pairs))  # 2 of 3 copies of prompt 0


def test_a_failing_flash_kernel_falls_back_to_the_exact_masked_path(tiny_model_dir, monkeypatch):
    """A GPU without flash attention (or an older torch spelling) warns once and stays exact."""
    from polyrl.learner import packing

    model = load_causal_lm(str(tiny_model_dir))
    batch, _, _ = _grpo_batch(seed=4)
    fwd = ForwardSettings(pack_on_cpu=True)
    with torch.no_grad():
        expected, _ = logprobs_and_entropy(model, batch, 1.0, False, fwd)

    def broken(*a, **k):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    monkeypatch.setattr(packing, "_cuda_kernel_usable", lambda q: not packing._VARLEN_BROKEN)
    monkeypatch.setattr(packing, "_cuda_varlen_kv", broken)
    monkeypatch.setattr(packing, "_kernel_dtype", lambda *t: t)  # keep fp32 (the CUDA path would cast to bf16)
    monkeypatch.setattr(packing, "_VARLEN_BROKEN", [])
    with torch.no_grad(), pytest.warns(UserWarning, match="falls back"):
        got, _ = logprobs_and_entropy(model, batch, 1.0, False, fwd)
    assert packing._VARLEN_BROKEN and "Ampere" in packing._VARLEN_BROKEN[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
