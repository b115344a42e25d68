"""Training-efficiency pieces on CPU: packing == padding, token-budget micro-batches don't change the update,
chunked log-probs == naive, the FLOPs formula against a hand count, and the rollout gap metric."""

import copy

import pytest
import torch

from polyrl.algorithms import entropy_from_logits
from polyrl.algorithms.losses import LossKnobs
from polyrl.models.loader import load_causal_lm
from polyrl.trainer.metrics import rollout_logprob_gap
from polyrl.learner.actor import (Actor, ForwardSettings, UpdateSettings, compute_logprobs, logprobs_and_entropy,
                                   make_scheduler)
from polyrl.learner.batch import build_batch, select
from polyrl.learner.dynamic_batch import balanced_micro_batches
from polyrl.learner.flops import matmul_params, mfu, training_flops
from polyrl.learner.fused_head import fused_logprobs
from polyrl.learner.logprobs import chunked_logprobs, naive_logprobs
from polyrl.learner.packing import pack

TOL = dict(rtol=0, atol=2e-5)  # fp32: packed vs padded differ only in summation order


def _rows(num_rows, seed=0, max_prompt=12, max_resp=9):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 90, (int(torch.randint(2, max_prompt, (1,), generator=g)),), generator=g).tolist()
               for _ in range(num_rows)]
    responses = [torch.randint(4, 90, (int(torch.randint(1, max_resp, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(num_rows)]
    return prompts, responses


def _batch(num_rows=8, seed=0):
    prompts, responses = _rows(num_rows, seed)
    batch = build_batch(prompts, responses, pad_token_id=0, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(seed + 1)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]
    return batch, prompts, responses


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_equals_padded_equals_one_sequence_at_a_time(tiny_model_dir, tiny_qwen2, arch):
    model = load_causal_lm(str(tiny_model_dir)).eval() if arch == "llama" else tiny_qwen2.eval()
    batch, prompts, responses = _batch(6)
    with torch.no_grad():
        packed, ent_p = logprobs_and_entropy(model, batch, 0.7, True, ForwardSettings(use_remove_padding=True,
                                                                                    pack_on_cpu=True))
        padded, ent_d = logprobs_and_entropy(model, batch, 0.7, True, ForwardSettings(use_remove_padding=False))
        for i, (p, r) in enumerate(zip(prompts, responses)):  # the ground truth: each sequence alone, no padding
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1].float() / 0.7
            alone = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
            torch.testing.assert_close(packed[i, :len(r)], alone, **TOL)
            torch.testing.assert_close(ent_p[i, :len(r)], entropy_from_logits(logits), **TOL)
            assert (packed[i, len(r):] == 0).all()
    torch.testing.assert_close(packed, padded, **TOL)
    torch.testing.assert_close(ent_p, ent_d, **TOL)
    assert model.config._attn_implementation == "sdpa"  # switched back after the packed pass (generate needs it)


def test_pack_layout_has_no_padding_and_restarting_positions():
    batch, prompts, responses = _batch(4)
    packed = pack(batch)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    assert packed.num_tokens == sum(lengths)
    assert packed.cu_seqlens.tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()
    assert packed.input_ids[0].tolist() == [t for p, r in zip(prompts, responses) for t in p + r]
    assert packed.position_ids[0].tolist() == [i for n in lengths for i in range(n)]
    assert packed.targets.tolist() == [t for r in responses for t in r]


def test_packed_gradients_equal_padded_gradients(tiny_model_dir):
    base = load_causal_lm(str(tiny_model_dir))
    batch, _, _ = _batch(5)
    grads = []
    for use_remove_padding in (True, False):
        model = copy.deepcopy(base)
        fwd = ForwardSettings(use_remove_padding=use_remove_padding, pack_on_cpu=True, logprob_chunk_size=7)
        logp, ent = logprobs_and_entropy(model, batch, 1.0, True, fwd)
        ((logp * batch["advantages"]).sum() + 0.1 * ent.sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().max() > 1e-3
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-5)


def _settings(**kw):
    base = dict(mini_batch_size=12, micro_batch_size=12, ppo_epochs=1, temperature=1.0, loss_mode="vanilla",
                loss_agg_mode="token-mean", knobs=LossKnobs(), grad_clip=1e9, entropy_coeff=0.01,
                use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    base.update(kw)
    return UpdateSettings(**base)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_micro_batches_give_the_same_update(tiny_model_dir, mode):
    base = load_causal_lm(str(tiny_model_dir))
    batch, _, _ = _batch(12, seed=3)
    batch["old_log_probs"] = compute_logprobs(base, batch, temperature=1.0, micro_batch_size=12) + 0.05
    batch["ref_log_probs"] = batch["old_log_probs"] - 0.1
    longest = int(batch["attention_mask"].sum(1).max())
    results, metrics = [], []
    for max_token_len in (None, longest, 2 * longest):  # one micro-batch vs several balanced token-cut ones
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        actor = Actor(model, opt, make_scheduler(opt, total_steps=1, warmup_steps=0, kind="constant",
                                                 min_lr_ratio=0.0, num_cycles=0.5),
                      fwd=ForwardSettings(pack_on_cpu=True))  # packed micro-batches, as on GPU
        metrics.append(actor.update(batch, _settings(loss_agg_mode=mode, max_token_len=max_token_len)))
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert (results[0] - torch.cat([p.flatten() for p in base.parameters()])).abs().max() > 1e-4
    for r in results[1:]:
        torch.testing.assert_close(r, results[0], rtol=0, atol=1e-6)
    for m in metrics[1:]:
        for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac"):
            assert m[k] == pytest.approx(metrics[0][k], abs=1e-5), k


def test_balanced_micro_batches_respect_budget_and_balance():
    lengths = [900, 100, 500, 500, 300, 700, 200, 800]  # 4000 tokens
    groups = balanced_micro_batches(lengths, 1000)
    assert sorted(i for g in groups for i in g) == list(range(8))
    sums = [sum(lengths[i] for i in g) for g in groups]
    assert len(groups) == 4 and max(sums) <= 1000  # the fewest that can hold 4000 tokens
    assert max(sums) - min(sums) <= 200
    assert balanced_micro_batches([600, 600, 600], 1000) == [[0], [1], [2]]  # greedy overflows at k=2: adds one
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):
        balanced_micro_batches([1200, 10], 1000)


@pytest.mark.parametrize("impl", ["chunked", "fused"])
@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_chunked_logprobs_equal_naive_values_and_gradients(chunk_size, impl):
    """Both memory-lean heads (autograd through checkpointed chunks; hand-written backward) equal full logits."""
    g = torch.Generator().manual_seed(0)
    h0, w0, b0 = torch.randn(10, 16, generator=g), torch.randn(50, 16, generator=g), torch.randn(50, generator=g)
    y = torch.randint(0, 50, (10,), generator=g)
    g_logp, g_ent = torch.randn(10, generator=g), torch.randn(10, generator=g)  # arbitrary upstream gradients
    lean = chunked_logprobs if impl == "chunked" else fused_logprobs
    outs = []
    for fn in (naive_logprobs, lambda *a, **k: lean(*a, chunk_size=chunk_size, **k)):
        h, w, b = (t.clone().requires_grad_() for t in (h0, w0, b0))
        logp, ent = fn(h, w, y, bias_V=b, temperature=0.8, with_entropy=True)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        outs.append((logp.detach(), ent.detach(), h.grad, w.grad, b.grad))
    for naive, chunked in zip(*outs):
        torch.testing.assert_close(chunked, naive, rtol=1e-5, atol=1e-5)
    assert lean(h0, w0, y, with_entropy=False)[1] is None
    h = h0.clone().requires_grad_()  # log-probs alone: the entropy term must drop out of the gradient
    lean(h, w0, y, with_entropy=False, chunk_size=chunk_size)[0].sum().backward()
    h_ref = h0.clone().requires_grad_()
    naive_logprobs(h_ref, w0, y)[0].sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-5)


def test_flops_match_a_hand_count_for_qwen2_5_1_5b():
    cfg = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
               intermediate_size=8960, vocab_size=151936)
    # per layer: q 1536*1536 + k,v 2*1536*256 + o 1536*1536 = 5,505,024; MLP 3*1536*8960 = 41,287,680
    trunk, head = matmul_params(cfg)
    assert trunk == 28 * (5_505_024 + 41_287_680) == 1_310_195_712
    assert head == 151936 * 1536 == 233_373_696
    # two sequences of 1000 and 3000 tokens, LM head on 2500 of them
    attn = 12 * 28 * 12 * 128 * (1000 ** 2 + 3000 ** 2)
    expected = 6 * (1_310_195_712 * 4000 + 233_373_696 * 2500) + attn
    assert training_flops(cfg, [1000, 3000], lm_head_tokens=2500) == expected
    assert mfu(expected, 1.0, peak=989e12) == pytest.approx(expected / 989e12)
    assert mfu(expected, 1.0, peak=0.0) == 0.0


def test_update_logs_rollout_gap_from_its_own_first_forward(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir))
    batch, _, _ = _batch(8, seed=5)
    current = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=4)
    g = torch.Generator().manual_seed(9)
    batch["rollout_log_probs"] = (current + 0.05 * torch.randn(current.shape, generator=g)) * batch["response_mask"]
    expected = rollout_logprob_gap(batch["rollout_log_probs"], current, batch["response_mask"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    actor = Actor(model, opt, make_scheduler(opt, total_steps=1, warmup_steps=0, kind="constant", min_lr_ratio=0.0,
                                             num_cycles=0.5))
    m = actor.update(batch, _settings(mini_batch_size=8, micro_batch_size=4, use_kl_loss=False,
                                      old_from_current=True))
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(expected["training/rollout_probs_diff_mean"],
                                                                  rel=1e-5)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(expected["training/rollout_probs_diff_max"],
                                                                 rel=1e-5)


def test_equal_size_partition_balances_tokens_with_equal_row_counts():
    from polyrl.learner.dynamic_batch import equal_size_partition

    g = torch.Generator().manual_seed(0)
    lengths = ((torch.rand(64, generator=g) ** 3) * 2000 + 50).long().tolist()  # long-tailed, like GRPO
    parts = equal_size_partition(lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(64)) and all(len(p) == 16 for p in parts)
    loads = [sum(lengths[i] for i in p) for p in parts]
    naive = [sum(lengths[i] for i in range(r * 16, (r + 1) * 16)) for r in range(4)]  # contiguous shards
    assert max(loads) / (sum(loads) / 4) < 1.02 < max(naive) / (sum(naive) / 4)
    with pytest.raises(ValueError, match="equal parts"):
        equal_size_partition(lengths[:10], 4)


def test_concat_rows_pads_prompts_left_and_responses_right():
    from polyrl.learner.batch import concat_rows

    a = build_batch([[5, 6, 7]], [[8]], pad_token_id=0, device=torch.device("cpu"))
    b = build_batch([[9]], [[10, 11, 12]], pad_token_id=0, device=torch.device("cpu"))
    b["advantages"] = torch.ones(1, 3)
    a["advantages"] = torch.ones(1, 1) * 2
    m = concat_rows([a, b])
    assert m["input_ids"].tolist() == [[5, 6, 7, 8, 0, 0], [0, 0, 9, 10, 11, 12]]
    assert m["responses"].tolist() == [[8, 0, 0], [10, 11, 12]]
    assert m["advantages"].tolist() == [[2, 0, 0], [1, 1, 1]]
    assert m["position_ids"][1, 2:].tolist() == [0, 1, 2, 3]
    for i, src in enumerate((a, b)):  # the packed view of each row is unchanged by the padding
        assert pack(select(m, torch.tensor([i]))).input_ids.tolist() == pack(src).input_ids.tolist()


def test_token_budget_micro_batches_follow_the_largest_count_of_any_rank():
    """Several processes: every rank runs as many micro-batches as the busiest one (empty ones are padding passes)."""
    from polyrl.learner.actor import _padding_pass, micro_batches

    class OtherRankNeedsFive:  # a DistEnv stand-in whose all_reduce(max) sees 5 micro-batches on another rank
        world_size = 2

        def all_reduce(self, t, op="sum"):
            assert op == "max"
            return torch.maximum(t, torch.tensor(5))

    batch, _, _ = _batch(3, seed=1)
    longest = int(batch["attention_mask"].sum(1).max())
    alone = micro_batches(batch, 1, 3 * longest)
    assert len(alone) == 1
    groups = micro_batches(batch, 1, 3 * longest, OtherRankNeedsFive())
    assert len(groups) == 5 and sorted(int(r) for g in groups for r in g) == [0, 1, 2]
    empties = [g for g in groups if len(g) == 0]
    assert len(empties) == 2 and _padding_pass(empties[0])[1] == 0.0 and _padding_pass(groups[0])[1] in (0.0, 1.0)


def test_padding_micro_batches_change_nothing(tiny_model_dir, monkeypatch):
    """A rank's empty micro-batch runs row 0 at loss weight 0: weights and metrics equal the run without it."""
    from polyrl.learner import actor as actor_mod

    base = load_causal_lm(str(tiny_model_dir))
    batch, _, _ = _batch(6, seed=4)
    batch["old_log_probs"] = compute_logprobs(base, batch, temperature=1.0, micro_batch_size=6) + 0.05
    batch["ref_log_probs"] = batch["old_log_probs"] - 0.1
    plain = actor_mod.micro_batches
    runs = []
    for extra in (0, 2):
        def with_padding(*args, _extra=extra, **kwargs):
            empty = torch.zeros(0, dtype=torch.long)
            return [torch.arange(s.start, s.stop) if isinstance(s, slice) else s for s in plain(*args, **kwargs)] \
                + [empty] * _extra
        monkeypatch.setattr(actor_mod, "micro_batches", with_padding)
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        actor = Actor(model, opt, make_scheduler(opt, total_steps=1, warmup_steps=0, kind="constant",
                                                 min_lr_ratio=0.0, num_cycles=0.5))
        m = actor.update(batch, _settings(mini_batch_size=6, micro_batch_size=3))
        runs.append((m, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (m0, w0), (m2, w2) = runs
    torch.testing.assert_close(w2, w0, rtol=0, atol=1e-6)
    for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/grad_norm"):
        assert m2[k] == pytest.approx(m0[k], abs=1e-6), k


@pytest.mark.parametrize("loss_mode,agg", [("vanilla", "token-mean"), ("gspo", "seq-mean-token-mean"),
                                           ("gpg", "seq-mean-token-sum-norm")])
@pytest.mark.parametrize("packed", [True, False])
def test_head_gradient_in_forward_gives_the_same_update(tiny_model_dir, loss_mode, agg, packed):
    """On-policy single pass: the LM head's backward run inside its forward (coefficients from `loss_coefficients`)
    changes the weights exactly as the ordinary backward through the loss does."""
    base = load_causal_lm(str(tiny_model_dir))
    batch, _, _ = _batch(10, seed=5)
    longest = int(batch["attention_mask"].sum(1).max())
    results, metrics = [], []
    for in_forward in (False, True):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        fwd = ForwardSettings(use_remove_padding=packed, pack_on_cpu=True, head_grad_in_forward=in_forward,
                              logprob_chunk_size=5)
        actor = Actor(model, opt, make_scheduler(opt, total_steps=1, warmup_steps=0, kind="constant",
                                                 min_lr_ratio=0.0, num_cycles=0.5), fwd=fwd)
        s = _settings(loss_mode=loss_mode, loss_agg_mode=agg, use_kl_loss=False, entropy_coeff=0.03,
                      old_from_current=True, max_token_len=2 * longest)
        metrics.append(actor.update(batch, s))
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert (results[0] - torch.cat([p.flatten() for p in base.parameters()])).abs().max() > 1e-4
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-6)
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert metrics[1][k] == pytest.approx(metrics[0][k], rel=1e-5, abs=1e-7), k


def test_loss_coefficients_equal_the_gradient_at_the_real_log_probs():
    from polyrl.learner.actor import loss_coefficients

    batch, _, _ = _batch(6, seed=2)
    mask = batch["response_mask"]
    logp = (torch.randn(mask.shape) - 2.0).requires_grad_()
    ent = torch.rand(mask.shape).requires_grad_()
    s = _settings(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.05, use_kl_loss=False, old_from_current=True)
    from polyrl.algorithms import agg_loss, policy_loss

    loss, _ = policy_loss("vanilla", old_log_prob_BT=logp.detach(), log_prob_BT=logp, advantages_BT=batch["advantages"],
                          response_mask_BT=mask, loss_agg_mode=s.loss_agg_mode, cfg=s.knobs, num_tokens=mask.sum(),
                          num_seqs=6)
    loss = loss - 0.05 * agg_loss(ent, mask, s.loss_agg_mode, num_tokens=mask.sum(), num_seqs=6)
    g_logp, g_ent = torch.autograd.grad(loss * 3.0, [logp, ent])
    c_logp, c_ent = loss_coefficients(s, batch, mask.sum(), 6, scale=3.0)
    assert g_logp.abs().max() > 1e-3
    torch.testing.assert_close(c_logp, g_logp)
    torch.testing.assert_close(c_ent, g_ent)


def test_activation_offload_gives_the_same_update(tiny_model_dir):
    """enable_activation_offload wraps the forward in torch's save_on_cpu; the update must not change. (On CPU the
    saved tensors only move host to host, so this checks the wiring, not the GPU memory saving.)"""
    base = load_causal_lm(str(tiny_model_dir))
    batch, _, _ = _batch(8, seed=7)
    batch["ref_log_probs"] = torch.zeros_like(batch["advantages"]) - 3.0
    results, calls = [], []
    real = torch.autograd.graph.save_on_cpu

    class Counting(real):
        def __init__(self, *a, **k):
            calls.append(1)
            super().__init__(*a, **k)

    torch.autograd.graph.save_on_cpu = Counting
    try:
        for offload in (False, True):
            model = copy.deepcopy(base)
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            actor = Actor(model, opt, make_scheduler(opt, total_steps=1, warmup_steps=0, kind="constant",
                                                     min_lr_ratio=0.0, num_cycles=0.5),
                          fwd=ForwardSettings(pack_on_cpu=True, activation_offload=offload))
            actor.update(batch, _settings(old_from_current=True))
            results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    finally:
        torch.autograd.graph.save_on_cpu = real
    assert calls  # the offloading context really wrapped the forward
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
