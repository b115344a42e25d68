"""Algorithm math against hand-computed numbers (the arithmetic is in the comments), plus invariance tests."""

import math

import numpy as np
import pytest
import torch

from polyrl.algorithms import (
    ADV_ESTIMATORS,
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    LossKnobs,
    agg_loss,
    apply_kl_in_reward,
    compute_advantage,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    make_kl_controller,
    masked_mean,
    masked_var,
    masked_whiten,
    overlong_penalty,
    policy_loss,
    register_adv_est,
    select_groups,
    value_loss,
)
from polyrl.errors import ConfigError

T = torch.tensor


def close(actual, expected, atol=1e-5):
    actual = torch.as_tensor(actual).detach().float()
    expected = torch.as_tensor(expected).detach().float()
    expected = expected.expand_as(actual) if expected.dim() == 0 else expected
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def outcome_rewards(scores, T_len=3, mask=None):
    """Token rewards with the whole score on the last valid token (as reward managers place it)."""
    mask = torch.ones(len(scores), T_len) if mask is None else T(mask, dtype=torch.float32)
    r = torch.zeros(len(scores), T_len)
    last = mask.sum(-1).long() - 1
    r[torch.arange(len(scores)), last] = T(scores, dtype=torch.float32)
    return r, mask


# --------------------------------------------------------------------------- masked helpers


def test_masked_mean_var_whiten_ignore_padding():
    values, mask = T([[1.0, 2.0, 3.0, 100.0]]), T([[1.0, 1.0, 1.0, 0.0]])
    # mean (1+2+3)/3 = 2; squared deviations 1,0,1 -> 2/3, Bessel 3/2 -> 1.0
    close(masked_mean(values, mask), 2.0)
    close(masked_var(values, mask), 1.0)
    close(masked_var(values, mask, unbiased=False), 2 / 3)
    close(masked_whiten(values, mask)[0, :3], [-1.0, 0.0, 1.0])
    # a NaN in padding does not leak into the mean
    close(masked_mean(T([[1.0, float("nan")]]), T([[1.0, 0.0]])), 1.0)


# --------------------------------------------------------------------------- advantage estimators


def test_grpo_group_normalisation_and_singletons():
    # groups: a=[1,0] mean .5, unbiased std sqrt(.5)=.70711 -> +-.5/.70711 = +-.70711
    #         b=[1,1] std 0 -> 0/(0+eps) = 0;   c=[2] singleton: mean 0, std 1 -> 2/(1+1e-6)
    r, mask = outcome_rewards([1.0, 0.0, 1.0, 1.0, 2.0], mask=[[1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantage("grpo", token_level_rewards_BT=r, response_mask_BT=mask, index=list("aabbc"))
    close(adv[:, 0], [0.707107, -0.707107, 0.0, 0.0, 2.0 / (1 + 1e-6)])
    assert torch.equal(adv, ret)
    assert torch.all(adv[mask == 0] == 0)  # broadcast over valid tokens only
    close(adv[0], [0.707107] * 3)


def test_grpo_three_member_group_uses_unbiased_std():
    # scores 0,1,2 (spread over tokens: 0.5+0.5 sums to 1): mean 1, unbiased std sqrt((1+0+1)/2) = 1
    r = T([[0.0, 0.0, 0.0], [0.5, 0.5, 0.0], [1.0, 0.0, 1.0]])
    adv, _ = compute_advantage("grpo", token_level_rewards_BT=r, response_mask_BT=torch.ones(3, 3), index=[7, 7, 7])
    close(adv[:, 0], [-1.0, 0.0, 1.0])


def test_grpo_matches_verl_per_row_loop_on_random_groups():
    """The scatter-add group statistics equal verl's loop over rows with torch.mean / torch.std."""
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 3, (24, 5), generator=g).float()
    index = [int(i) for i in torch.randint(0, 7, (24,), generator=g)]
    adv, _ = compute_advantage("grpo", token_level_rewards_BT=r, response_mask_BT=torch.ones(24, 5), index=index)
    scores = r.sum(-1)
    expected = []
    for i in range(24):
        members = torch.stack([scores[j] for j in range(24) if index[j] == index[i]])
        mean, std = (members.mean(), members.std()) if len(members) > 1 else (T(0.0), T(1.0))
        expected.append((scores[i] - mean) / (std + 1e-6))
    close(adv[:, 0], torch.stack(expected))


def test_dr_grpo_skips_std():
    r, mask = outcome_rewards([1.0, 0.0, 2.0])
    adv, _ = compute_advantage(
        "grpo", token_level_rewards_BT=r, response_mask_BT=mask, index=["a", "a", "c"], norm_adv_by_std_in_grpo=False
    )
    close(adv[:, 0], [0.5, -0.5, 2.0])  # s - mean; the singleton's mean is 0


def test_grpo_global_std_divides_by_the_batch_std():
    r, mask = outcome_rewards([1.0, 3.0, 2.0, 2.0], mask=[[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    index = [0, 0, 1, 1]
    adv, _ = compute_advantage("grpo", token_level_rewards_BT=r, response_mask_BT=mask, index=index,
                               global_std=True, epsilon=0.0)  # fmt: skip
    # group means 2 and 2 -> s - mean = [-1, 1, 0, 0]; batch std of [1, 3, 2, 2]: sqrt(2 / 3) = 0.8165 (unbiased)
    close(adv[:, 0], [-1.2247449, 1.2247449, 0.0, 0.0])
    assert float(adv[1, 2]) == 0.0 and float(adv[3, 1]) == 0.0  # padding stays 0
    per_group, _ = compute_advantage("grpo", token_level_rewards_BT=r, response_mask_BT=mask, index=index)
    close(per_group[:, 0], [-0.7071068, 0.7071068, 0.0, 0.0])  # group 0's std is sqrt(2); group 1's is 0


def test_grpo_global_std_singleton_and_adv_clip_max():
    r, mask = outcome_rewards([1.0, 3.0, 5.0])
    adv, ret = compute_advantage("grpo", token_level_rewards_BT=r, response_mask_BT=mask, index=["a", "a", "b"],
                                 global_std=True, adv_clip_max=2.0, epsilon=0.0)  # fmt: skip
    # means: a -> 2, the singleton b -> 0; s - mean = [-1, 1, 5]; batch std of [1, 3, 5] = 2 -> [-0.5, 0.5, 2.5]
    close(adv, torch.tensor([-0.5, 0.5, 2.0]).unsqueeze(-1).expand(3, 3))  # 2.5 clipped to 2
    close(ret[:, 0], [-0.5, 0.5, 2.5])  # returns are not clipped
    one, _ = compute_advantage("grpo", token_level_rewards_BT=r[:1], response_mask_BT=mask[:1], index=[0],
                               global_std=True, epsilon=0.0)  # fmt: skip
    close(one[:, 0], [1.0])  # a batch of one: mean 0, std 1


def test_flow_grpo_clip_fractions_are_on_the_ratio():
    from polyrl.algorithms.flow_grpo import clipped_loss

    # ratios exp(d): 1.5, 0.5, 1.5, 0.5, 1.0 with advantages +, +, -, -, +; clip 0.2
    d = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5, 1.0]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0])
    _, m = clipped_loss(d, torch.zeros(5), adv, clip_ratio=0.2, num_terms=5)
    # verl-omni's FlowGRPO fractions: above 1 + clip (2 of 5) / below 1 - clip (2 of 5), whatever the advantage sign
    assert float(m["actor/pg_clipfrac_higher"]) == 2 and float(m["actor/pg_clipfrac_lower"]) == 2  # sums over terms
    # loss: max(-A r, -A clip(r)) = [-1.2, -0.5, 1.5, 0.8, -1.0], sum -0.4, mean -0.08
    assert float(m["actor/pg_loss"]) / 5 == pytest.approx(-0.08, abs=1e-6)


def test_rloo_leave_one_out():
    # group [3,0,0]: 3 - mean(0,0) = 3; 0 - mean(3,0) = -1.5 (== 3/2 * (s - 1)); singleton keeps its score 5
    r, mask = outcome_rewards([3.0, 0.0, 0.0, 5.0])
    adv, _ = compute_advantage("rloo", token_level_rewards_BT=r, response_mask_BT=mask, index=[0, 0, 0, 1])
    close(adv[:, 0], [3.0, -1.5, -1.5, 5.0])


def test_opo_length_weighted_baseline():
    # group a: scores [1,0], lengths [1,3] -> baseline (1*1 + 3*0)/4 = .25 -> [.75, -.25]; singleton baseline 0
    r, mask = outcome_rewards([1.0, 0.0, 4.0], mask=[[1, 0, 0], [1, 1, 1], [1, 1, 0]])
    adv, _ = compute_advantage("opo", token_level_rewards_BT=r, response_mask_BT=mask, index=["a", "a", "b"])
    close(adv[:, 0], [0.75, -0.25, 4.0])
    close(adv[1], [-0.25] * 3)


def test_gpg_alpha_scales_by_nonzero_fraction():
    # B=4, one nonzero score -> alpha 4; group a=[1,0]: +-.5*4 = +-2; group b=[0,0]: 0
    r, mask = outcome_rewards([1.0, 0.0, 0.0, 0.0])
    adv, _ = compute_advantage("gpg", token_level_rewards_BT=r, response_mask_BT=mask, index=list("aabb"))
    close(adv[:, 0], [2.0, -2.0, 0.0, 0.0])


def test_remax_subtracts_greedy_baseline():
    r = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = compute_advantage(
        "remax", token_level_rewards_BT=r, response_mask_BT=mask, reward_baselines_B=T([0.5, 1.0])
    )
    close(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])  # return-to-go
    close(adv, [[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]])


def test_reinforce_plus_plus_discounted_and_whitened():
    # gamma .5: row0 [0,0,1] -> returns [.25,.5,1]; row1 [0,1,pad] -> [.5,1,0]
    # valid [.25,.5,1,.5,1]: mean .65, deviations -.4,-.15,.35,-.15,.35, sum sq .45, unbiased var .45/4=.1125,
    # std .335410 -> [-1.192570, -.447214, 1.043498, -.447214, 1.043498]
    r = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = compute_advantage("reinforce_plus_plus", token_level_rewards_BT=r, response_mask_BT=mask, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]])
    close(adv, [[-1.192570, -0.447214, 1.043498], [-0.447214, 1.043498, 0.0]])


def test_reinforce_plus_plus_baseline_group_mean_then_batch_whiten():
    # per-row: a=[1,0] -> +-.5; singleton b -> 1 - 0 = 1. Tokens (T=2): [.5,.5,-.5,-.5,1,1]
    # mean 1/3; deviations 1/6, -5/6, 2/3; sum sq 2*(1/36+25/36+16/36) = 7/3; var (7/3)/5 = .466667, std .683130
    r, mask = outcome_rewards([1.0, 0.0, 1.0], T_len=2)
    adv, _ = compute_advantage(
        "reinforce_plus_plus_baseline", token_level_rewards_BT=r, response_mask_BT=mask, index=list("aab")
    )
    close(adv[:, 0], [0.243975, -1.219875, 0.975900])
    close(adv[:, 1], adv[:, 0])


def test_gae_skips_padding_and_whitens():
    # gamma 1, lam .5. row0 r [0,0,1], V [.5,.5,.5]:
    #   t2 delta .5 -> .5; t1 delta 0 -> .25; t0 -> .125; returns = adv + V = [.625,.75,1]
    # row1 r [0,1,pad], V [.2,.4,9.9(pad)]: the padded step is skipped (next value 0, gae 0)
    #   t1 delta 1 + 0 - .4 = .6; t0 delta 0 + .4 - .2 = .2, gae .2 + .5*.6 = .5; returns [.7, 1.0]
    # whiten [.125,.25,.5,.5,.6]: mean .395, sum sq dev .158, var .158/4 = .0395, std .198746
    r = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = T([[0.5, 0.5, 0.5], [0.2, 0.4, 9.9]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = compute_advantage("gae", token_level_rewards_BT=r, response_mask_BT=mask, values_BT=values, lam=0.5)
    close(ret[0], [0.625, 0.75, 1.0])
    close(ret[1, :2], [0.7, 1.0])
    close(adv, [[-1.358516, -0.729573, 0.528315], [0.528315, 1.031473, 0.0]])


def test_estimator_errors_name_the_key_and_choices():
    r, mask = outcome_rewards([1.0, 0.0])
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator='grp0'.*'grpo'"):
        compute_advantage("grp0", token_level_rewards_BT=r, response_mask_BT=mask, index=[0, 0])
    with pytest.raises(ConfigError, match="critic"):
        compute_advantage("gae", token_level_rewards_BT=r, response_mask_BT=mask)
    with pytest.raises(ConfigError, match="group ids"):
        compute_advantage("grpo", token_level_rewards_BT=r, response_mask_BT=mask)
    with pytest.raises(ValueError, match="3 entries"):
        compute_advantage("grpo", token_level_rewards_BT=r, response_mask_BT=mask, index=[0, 0, 1])


def test_registry_accepts_new_estimators():
    @register_adv_est("_test_zero")
    def zero(*, token_level_rewards_BT, **_):
        z = torch.zeros_like(token_level_rewards_BT)
        return z, z

    try:
        ones = torch.ones(2, 2)
        adv, _ = compute_advantage("_test_zero", token_level_rewards_BT=ones, response_mask_BT=ones)
        assert torch.equal(adv, torch.zeros(2, 2))
    finally:
        ADV_ESTIMATORS.pop("_test_zero")
    assert {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg"} <= set(
        ADV_ESTIMATORS
    )


# --------------------------------------------------------------------------- loss aggregation

LOSS_MAT = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 7.0, 7.0]])
AGG_MASK = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # last row fully masked: not a sequence


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),  # (1+2+4) / 3 tokens
        ("token-sum", 7.0),
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 sequences
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", 3.5 / 3),  # seq-mean-token-sum / T
    ],
)
def test_agg_loss_modes(mode, expected):
    close(agg_loss(LOSS_MAT, AGG_MASK, mode), expected)


def test_agg_loss_scale_factor_and_unknown_mode():
    close(agg_loss(LOSS_MAT, AGG_MASK, "seq-mean-token-sum-norm", loss_scale_factor=7), 0.5)
    with pytest.raises(ConfigError, match="loss_agg_mode='token_mean'"):
        agg_loss(LOSS_MAT, AGG_MASK, "token_mean")


def _mini_batch(seed=0, B=8, T_len=6):
    g = torch.Generator().manual_seed(seed)
    lengths = T([6, 1, 3, 5, 2, 6, 4, 1])
    mask = (torch.arange(T_len)[None, :] < lengths[:, None]).float()
    loss_mat = torch.randn(B, T_len, generator=g)
    loss_mat[mask == 0] = 1e6  # garbage in padding must not matter
    return loss_mat, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("split", [[8], [1] * 8, [4, 4]])
def test_agg_loss_micro_batch_invariance(mode, split):
    loss_mat, mask = _mini_batch()
    one_shot = agg_loss(loss_mat, mask, mode)
    num_tokens, num_seqs = mask.sum(), mask.shape[0]
    parts = zip(loss_mat.split(split), mask.split(split))
    total = sum(agg_loss(l, m, mode, num_tokens=num_tokens, num_seqs=num_seqs) for l, m in parts)
    close(total, one_shot.item(), atol=1e-5)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gpg"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_policy_loss_gradient_micro_batch_invariance(name, mode):
    """Summing micro-batch losses (global normalisers) gives the one-shot loss *and* gradient."""
    _, mask = _mini_batch()
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(8, 6, generator=g) * 2
    adv = torch.randn(8, 6, generator=g)
    new = (old + 0.3 * torch.randn(8, 6, generator=g)).requires_grad_(True)
    cfg = LossKnobs(clip_ratio_high=0.28)

    def run(rows):
        loss, _ = policy_loss(
            name, old_log_prob_BT=old[rows], log_prob_BT=new[rows], advantages_BT=adv[rows],
            response_mask_BT=mask[rows], loss_agg_mode=mode, cfg=cfg, num_tokens=mask.sum(), num_seqs=8,
        )  # fmt: skip
        return loss

    one_shot = run(slice(0, 8))
    (grad_one,) = torch.autograd.grad(one_shot, new)
    for split in ([1] * 8, [4, 4]):
        bounds = np.cumsum([0] + split)
        total = sum(run(slice(a, b)) for a, b in zip(bounds[:-1], bounds[1:]))
        (grad_split,) = torch.autograd.grad(total, new)
        close(total, one_shot.item())
        torch.testing.assert_close(grad_split, grad_one, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- policy losses


def _pl(name, log_ratio, adv, mask=None, old=None, mode="token-mean", **cfg):
    log_ratio = log_ratio if torch.is_tensor(log_ratio) else T([log_ratio])
    adv = adv if torch.is_tensor(adv) else T([adv])
    old = torch.full_like(log_ratio, -1.0) if old is None else old
    new = (old + log_ratio).requires_grad_(True)
    mask = torch.ones_like(log_ratio) if mask is None else mask
    loss, metrics = policy_loss(
        name, old_log_prob_BT=old, log_prob_BT=new, advantages_BT=adv, response_mask_BT=mask,
        loss_agg_mode=mode, cfg=LossKnobs(**cfg),
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, new)
    return loss, metrics, grad


def test_vanilla_ppo_clip_and_dual_clip():
    # eps .2, clip_ratio_c 3. Per token (A, ratio) -> loss:
    #   (+1, 1.5): max(-1.5, -1.2) = -1.2   clipped (constant: grad 0)
    #   (+1, 0.5): max(-0.5, -0.8) = -0.5   grad -A*r = -0.5
    #   (-1, 0.5): max( 0.5,  0.8) =  0.8   clipped (grad 0)
    #   (-1, 4.0): max( 4.0,  1.2) =  4.0 -> dual clip min(3, 4) = 3 (grad 0), counted in clipfrac_lower
    #   (-1, 1.0): 1.0                       grad -A*r = 1
    # token-mean (-1.2-.5+.8+3+1)/5 = .62; clipfrac 2/5; lower 1/5; ppo_kl = -mean(log r) = -log(1.5)/5
    ratios = [1.5, 0.5, 0.5, 4.0, 1.0]
    loss, m, grad = _pl("vanilla", [math.log(r) for r in ratios], [1.0, 1.0, -1.0, -1.0, -1.0])
    close(loss, 0.62)
    close(m["actor/pg_clipfrac"], 0.4)
    close(m["actor/pg_clipfrac_lower"], 0.2)
    close(m["actor/ppo_kl"], -math.log(1.5) / 5)
    close(grad, [[0.0, -0.1, 0.0, 0.0, 0.2]])
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())


def test_vanilla_clip_higher_dapo():
    # A=+1, ratio 1.25: symmetric eps .2 clips at 1.2 (loss -1.2); clip-higher .28 leaves it (-1.25)
    # A=+1, ratio 1.5: clip-higher clips at 1.28
    lr = [math.log(1.25), math.log(1.5)]
    sym, m_sym, _ = _pl("vanilla", lr, [1.0, 1.0])
    high, m_high, _ = _pl("vanilla", lr, [1.0, 1.0], clip_ratio_low=0.2, clip_ratio_high=0.28)
    close(sym, (-1.2 - 1.2) / 2)
    close(high, (-1.25 - 1.28) / 2)
    close(m_sym["actor/pg_clipfrac"], 1.0)
    close(m_high["actor/pg_clipfrac"], 0.5)
    # the low side still uses 0.2: A=-1, ratio .7 -> max(.7, .8) = .8
    low, _, _ = _pl("vanilla", [math.log(0.7)], [-1.0], clip_ratio_low=0.2, clip_ratio_high=0.28)
    close(low, 0.8)


def test_on_policy_ratio_one_gives_minus_mean_advantage():
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(3, 4, generator=g)
    mask = T([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    loss, m, grad = _pl("vanilla", torch.zeros(3, 4), adv, mask=mask)
    close(loss, -(adv * mask).sum() / mask.sum())
    close(m["actor/pg_clipfrac"], 0.0)
    close(m["actor/pg_clipfrac_lower"], 0.0)
    close(m["actor/ppo_kl"], 0.0)
    close(grad, -adv * mask / mask.sum())  # d(-A r)/dlogp = -A r, r = 1


def test_vanilla_clamps_log_ratio_and_rejects_bad_clip_ratio_c():
    # log-ratio 100 is clamped to 20: with A=-1 the dual clip caps the loss at 3 anyway, but ppo_kl sees -20
    loss, m, _ = _pl("vanilla", [100.0], [-1.0])
    close(loss, 3.0)
    close(m["actor/ppo_kl"], -20.0)
    with pytest.raises(ConfigError, match="clip_ratio_c=1.0"):
        _pl("vanilla", [0.0], [1.0], clip_ratio_c=1.0)


def test_gspo_sequence_ratio_follows_loss_agg_mode():
    # row0: log-ratios [ln2, 0] -> seq ratio exp(ln2/2) = 1.41421, A=+1 -> clipped at 1.2: losses [-1.2, -1.2]
    # row1: log-ratio [ln .9] (second token padding) -> seq ratio .9, A=-1 -> max(.9, clip(.9)=.9) = .9
    # verl 0.9.1 aggregates with the configured mode: token-mean (-1.2 - 1.2 + .9)/3 = -.5;
    # seq-mean-token-mean (verl <= 0.8's forced mode) (-1.2 + .9)/2 = -.15
    # clipfrac 2/3; ppo_kl = -(ln2 + ln.9)/3; grad on row1's token: d(-A s)/dlogp = .9, / 3 tokens (token-mean)
    log_ratio = T([[math.log(2.0), 0.0], [math.log(0.9), 0.0]])
    adv = T([[1.0, 1.0], [-1.0, -1.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    loss, m, grad = _pl("gspo", log_ratio, adv, mask=mask, mode="token-mean")
    close(loss, -0.5)
    close(m["actor/pg_clipfrac"], 2 / 3)
    close(m["actor/ppo_kl"], -(math.log(2.0) + math.log(0.9)) / 3)
    close(grad, [[0.0, 0.0], [0.3, 0.0]])
    loss, _, grad = _pl("gspo", log_ratio, adv, mask=mask, mode="seq-mean-token-mean")
    close(loss, -0.15)
    close(grad, [[0.0, 0.0], [0.45, 0.0]])


def test_gpg_loss_is_plain_policy_gradient():
    # losses -logp*A: logp [-1,-2], A [1,-1] -> [1, -2], token-mean -.5; grad -A/2
    old = T([[-1.0, -2.0]])
    loss, metrics, grad = _pl("gpg", torch.zeros(1, 2), [1.0, -1.0], old=old)
    close(loss, -0.5)
    close(grad, [[-0.5, 0.5]])
    assert metrics == {}


def test_clip_cov_cuts_gradient_of_high_covariance_token():
    # on-policy (ratio 1). A = [2,-2,1,-1] (mean 0), logp = [-1,-3,-1.5,-2] (mean -1.875)
    # cov = A*(logp+1.875) = [1.75, 2.25, .375, .125]; window (1, 2) -> only token 0; 1 token cut
    # losses -A*1*keep = [0, 2, -1, 1] -> mean .5; clipfrac 1/4; grad of token 0 is 0
    old = T([[-1.0, -3.0, -1.5, -2.0]])
    loss, m, grad = _pl("clip_cov", torch.zeros(1, 4), [2.0, -2.0, 1.0, -1.0], old=old, clip_cov_ub=2.0)
    close(loss, 0.5)
    close(m["actor/pg_clipfrac"], 0.25)
    close(m["actor/ppo_kl"], 0.0)
    close(grad, [[0.0, 0.5, -0.25, 0.25]])


def test_kl_cov_penalises_top_covariance_token():
    # A and logp as above -> cov [1.75, 2.25, .375, .125]: top-1 (4 * 2e-4 -> at least 1) is token 1
    # log-ratios [.1, .2, 0, 0]; losses -A e^lr: [-2e^.1, 2e^.2 + .1*|.2|, -1, 1]
    #   = [-2.210342, 2.442806 + .02, -1, 1] -> mean .063116; ppo_kl = mean|lr| = .075
    logp = T([[-1.0, -3.0, -1.5, -2.0]])
    lr = T([[0.1, 0.2, 0.0, 0.0]])
    loss, m, _ = _pl("kl_cov", lr, [2.0, -2.0, 1.0, -1.0], old=logp - lr)
    close(loss, (-2 * math.exp(0.1) + 2 * math.exp(0.2) + 0.02) / 4)
    close(m["actor/ppo_kl"], 0.075)


def test_unknown_policy_loss():
    with pytest.raises(ConfigError, match=r"loss_mode='ppo'.*'vanilla'"):
        _pl("ppo", [0.0], [1.0])


# --------------------------------------------------------------------------- value loss, logits helpers


def test_value_loss_clipped():
    # V_old .5, clip .2 -> vpred clipped into [.3, .7]; R = 1
    #   v=1: l1 0, l2 (.7-1)^2 = .09 -> .09 (clipped);  v=2: l1 1, l2 .09 -> 1;  v=0: l1 1, l2 .49 -> 1
    # 0.5 * (.09 + 1 + 1)/3 = .348333; clipfrac 1/3
    vf_loss, clipfrac = value_loss(
        T([[1.0, 2.0, 0.0]]), T([[1.0, 1.0, 1.0]]), T([[0.5, 0.5, 0.5]]), torch.ones(1, 3), 0.2, "token-mean"
    )
    close(vf_loss, 0.348333)
    close(clipfrac, 1 / 3)


def test_entropy_and_logprobs_from_logits():
    # [0, 0]: entropy ln 2. [0, ln3]: p = [.25, .75], H = .25 ln4 + .75 ln(4/3) = .562335, log p[1] = ln .75
    logits = T([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    close(entropy_from_logits(logits), [[math.log(2.0), 0.562335]])
    close(logprobs_from_logits(logits, T([[0, 1]])), [[math.log(0.5), math.log(0.75)]])
    close(logprobs_from_logits(logits.bfloat16(), T([[0, 1]])), [[math.log(0.5), math.log(0.75)]], atol=1e-2)


# --------------------------------------------------------------------------- KL


def test_kl_kinds():
    # d = log p - log ref = ln .5 - ln .25 = ln 2 = .693147
    lp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    close(kl_penalty("kl", lp, ref), [0.693147])
    close(kl_penalty("k1", ref, lp), [-0.693147])
    close(kl_penalty("abs", ref, lp), [0.693147])
    close(kl_penalty("mse", lp, ref), [0.5 * 0.693147**2])  # .240227
    close(kl_penalty("k2", lp, ref), [0.240227])
    # k3: exp(ref - lp) - (ref - lp) - 1 = .5 + .693147 - 1 = .193147
    close(kl_penalty("low_var_kl", lp, ref), [0.193147])
    close(kl_penalty("k3", lp, ref), [0.193147])
    # clamps: ref - lp = 30 -> 20, exp(20) - 21 huge -> 10
    close(kl_penalty("k3", T([-30.0]), T([0.0])), [10.0])


def test_straight_through_plus_takes_k2_gradient():
    lp = T([math.log(0.5), -1.0, -3.0]).requires_grad_(True)
    ref = T([math.log(0.25), -1.5, -0.2])
    k3_plus = kl_penalty("k3+", lp, ref)
    close(k3_plus.detach(), kl_penalty("k3", lp, ref).detach())  # value of k3
    (g_plus,) = torch.autograd.grad(k3_plus.sum(), lp)
    (g_k2,) = torch.autograd.grad(kl_penalty("k2", lp, ref).sum(), lp)
    (g_k3,) = torch.autograd.grad(kl_penalty("k3", lp, ref).sum(), lp)
    torch.testing.assert_close(g_plus, g_k2)
    close(g_k2[0], 0.693147)  # d(0.5 d^2)/dlp = d
    close(g_k3[0], 0.5)  # d(e^{-d} + d - 1)/dlp = 1 - e^{-d} = 1 - .5: different, so the swap matters
    (g_k1p,) = torch.autograd.grad(kl_penalty("kl+", lp, ref).sum(), lp)
    torch.testing.assert_close(g_k1p, g_k2)
    torch.testing.assert_close(kl_penalty("mse+", lp, ref), kl_penalty("mse", lp, ref))


def test_kl_kind_errors():
    with pytest.raises(ConfigError, match="low_var_kl"):
        kl_penalty("full", T([0.0]), T([0.0]))
    with pytest.raises(ConfigError, match="'k4'"):
        kl_penalty("k4", T([0.0]), T([0.0]))


def test_kl_controllers():
    fixed = FixedKLController(kl_coef=0.05)
    fixed.update(1.0, 100)
    assert fixed.value == 0.05
    # adaptive: err = clip(kl/target - 1, +-.2); beta *= 1 + err * n / horizon
    ctl = AdaptiveKLController(kl_coef=0.1, target_kl=0.1, horizon=100)
    ctl.update(0.2, 10)  # err clip(1) = .2 -> *1.02
    assert ctl.value == pytest.approx(0.102)
    ctl.update(0.05, 10)  # err -.5 -> -.2 -> *.98
    assert ctl.value == pytest.approx(0.09996)
    ctl.update(0.11, 10)  # err .1 -> *1.01
    assert ctl.value == pytest.approx(0.09996 * 1.01)
    assert isinstance(make_kl_controller("adaptive", 0.1, 0.1, 5), AdaptiveKLController)
    with pytest.raises(ConfigError, match="horizon=0"):
        make_kl_controller("adaptive", horizon=0)
    with pytest.raises(ConfigError, match="kl_ctrl.type='pid'"):
        make_kl_controller("pid")


def test_apply_kl_in_reward():
    # d = old - ref; kind kl; beta .1. masked KL [[.1,.2,.3],[.4,.5,0]]
    # rewards = scores - .1 * KL; batch KL = mean(mean(.1,.2,.3), mean(.4,.5)) = mean(.2, .45) = .325
    scores = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    ref = torch.zeros(2, 3)
    old = T([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards, m = apply_kl_in_reward(scores, old, ref, mask, FixedKLController(0.1), "kl")
    close(rewards, [[-0.01, -0.02, 0.97], [-0.04, 0.95, 0.0]])
    close(m["actor/reward_kl_penalty"], 0.325)
    close(m["actor/reward_kl_penalty_coeff"], 0.1)
    # adaptive: err clip(3.25 - 1) = .2, n = 2 sequences, horizon 10 -> beta .1 * 1.04; metric shows beta used
    ctl = AdaptiveKLController(kl_coef=0.1, target_kl=0.1, horizon=10)
    _, m = apply_kl_in_reward(scores, old, ref, mask, ctl, "kl")
    assert ctl.value == pytest.approx(0.104)
    close(m["actor/reward_kl_penalty_coeff"], 0.1)


# --------------------------------------------------------------------------- DAPO


def test_overlong_penalty_linear_in_buffer():
    # L_max 20, buffer 4 -> free up to 16, then -(L-16)/4: 17 -> -.25, 18 -> -.5, 20 -> -1; 25 capped at 20
    lengths = T([10, 16, 17, 18, 20, 25])
    pen = overlong_penalty(lengths, max_response_length=20, overlong_buffer_len=4, penalty_factor=1.0)
    close(pen, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(overlong_penalty(T([18]), 20, 4, 0.5), [-0.25])
    with pytest.raises(ConfigError, match="overlong_buffer_cfg.len=0"):
        overlong_penalty(T([1]), 20, 0, 1.0)


def test_select_groups_drops_constant_groups():
    # a: all 1 (drop); b: [0,1] (keep); c: three 0.1 (drop: np.std would give 1e-17 > 0); d: singleton (keep)
    metric = T([1.0, 1.0, 0.0, 1.0, 0.1, 0.1, 0.1, 5.0], dtype=torch.float64)
    index = ["a", "a", "b", "b", "c", "c", "c", "d"]
    kept, row_mask = select_groups(metric, index)
    assert kept == ["b", "d"]
    assert row_mask.tolist() == [False, False, True, True, False, False, False, True]
    kept, row_mask = select_groups(metric.tolist(), np.array(index), keep_singletons=False)
    assert kept == ["b"]
    assert row_mask.sum().item() == 2


# --------------------------------------------------------------------------- verl 0.9.1 parity (issue 20)


def test_rloo_group_of_one_keeps_its_raw_score():
    """verl's `rloo` keeps a lone sample's score, its `rloo_vectorized` gives 0: polyrl follows `rloo` (documented
    in advantages.py and docs/algorithms.md)."""
    r, mask = outcome_rewards([2.0, 1.0, 3.0, 0.0])
    idx = ["a", "b", "c", "c"]
    adv, _ = compute_advantage("rloo", token_level_rewards_BT=r, response_mask_BT=mask, index=idx)
    close(adv[:, 0], [2.0, 1.0, 3.0, -3.0])
    adv, _ = compute_advantage("rloo_vectorized", token_level_rewards_BT=r, response_mask_BT=mask, index=idx)
    close(adv[:, 0], [0.0, 0.0, 3.0, -3.0])  # verl's other spelling: lone samples get 0
    adv, _ = compute_advantage("grpo_vectorized", token_level_rewards_BT=r, response_mask_BT=mask, index=idx)
    close(adv, compute_advantage("grpo", token_level_rewards_BT=r, response_mask_BT=mask, index=idx)[0])


def test_reinforce_plus_plus_carries_the_return_across_mask_holes():
    # gamma .5, r [0, 9, 1], mask [1, 0, 1]: t2 -> 1; t1 masked: its reward is ignored, the running return 1 passes
    # through undiscounted and the position's return is 0; t0 -> 0 + .5 * 1 = .5. (verl <= 0.9.0 reset it: [0, .5, 1])
    # whitened over [.5, 1]: mean .75, unbiased var .125, std .353553 -> [-.707107, 0, .707107]
    r, mask = T([[0.0, 9.0, 1.0]]), T([[1.0, 0.0, 1.0]])
    adv, ret = compute_advantage("reinforce_plus_plus", token_level_rewards_BT=r, response_mask_BT=mask, gamma=0.5)
    close(ret, [[0.5, 0.0, 1.0]])
    close(adv, [[-0.707107, 0.0, 0.707107]])


def test_grpo_passk_rewards_only_the_best_of_each_group():
    # group a [1, 3, 2]: best is row 1, gap 3 - 2 = 1, std 1 -> 1 / (1 + 1e-6); group b ties [5, 5]: gap 0
    r, mask = outcome_rewards([1.0, 3.0, 2.0, 5.0, 5.0])
    idx = list("aaabb")
    adv, _ = compute_advantage("grpo_passk", token_level_rewards_BT=r, response_mask_BT=mask, index=idx)
    close(adv[:, 0], [0.0, 1.0 / (1 + 1e-6), 0.0, 0.0, 0.0])
    adv, _ = compute_advantage("grpo_passk", token_level_rewards_BT=r * 2, response_mask_BT=mask, index=idx,
                               norm_adv_by_std_in_grpo=False)
    close(adv[:, 0], [0.0, 2.0, 0.0, 0.0, 0.0])  # Dr.GRPO: the raw gap 6 - 4
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        compute_advantage("grpo_passk", token_level_rewards_BT=r, response_mask_BT=mask, index=list("aaabc"))


def test_gdpo_normalises_each_component_then_whitens():
    # groups aabb, components c1 = [1, 0, 1, 0], c2 = [0, 1, 1, 1] (eps 1e-6 ignored below)
    # c1 per group: [.7071, -.7071, .7071, -.7071]; c2: group a [-.7071, .7071], group b constant -> [0, 0]
    # weights [1, 2]: [-.7071, .7071, .7071, -.7071] -> whiten (mean 0, unbiased var 2/3) -> +-.866025
    # weights [1, 1]: [0, 0, .7071, -.7071] -> whiten (var 1/3) -> [0, 0, 1.224745, -1.224745]
    r, mask = outcome_rewards([1.0, 1.0, 2.0, 1.0], T_len=1)
    comps = T([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    kw = dict(token_level_rewards_BT=r, response_mask_BT=mask, index=list("aabb"), reward_components_KB=comps)
    adv, _ = compute_advantage("gdpo", reward_weights_K=[1.0, 2.0], **kw)
    close(adv[:, 0], [-0.866025, 0.866025, 0.866025, -0.866025], atol=1e-4)
    adv, _ = compute_advantage("gdpo", **kw)
    close(adv[:, 0], [0.0, 0.0, 1.224745, -1.224745], atol=1e-4)


def _otb(name, rewards, mask, pi, sum_sq=0.5, index=("a", "a"), is_weights=None):
    mask = T(mask)
    return compute_advantage(name, token_level_rewards_BT=T(rewards), response_mask_BT=mask, index=list(index),
                             old_log_probs_BT=torch.log(T(pi)).expand_as(mask).contiguous(),
                             sum_pi_squared_BT=torch.full_like(mask, sum_sq), rollout_is_weights_BT=is_weights)


def test_optimal_token_baseline_per_position():
    # w = 1 - 2 pi + sum pi^2: row 0 pi .5 -> .5, row 1 pi .25 -> 1; W = cumsum: [.5, 1] and [1, 2]
    # rewards r0 = [0, 1], r1 = [1, 0] -> returns G0 = [1, 1], G1 = [1, 0]
    # B_0 = (1*.5 + 1*1) / 1.5 = 1; B_1 = (1*1 + 0*2) / 3 = 1/3 -> A0 = [0, 2/3], A1 = [0, -1/3]
    adv, ret = _otb("optimal_token_baseline", [[0.0, 1.0], [1.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]], [[0.5], [0.25]])
    close(ret, [[1.0, 1.0], [1.0, 0.0]])
    close(adv, [[0.0, 2 / 3], [0.0, -1 / 3]])
    # rollout IS weights scale w by rho^2: row 0 rho 2 -> w 2, W [2, 4]; B_0 = (2 + 1)/3 = 1, B_1 = 4/6
    adv, _ = _otb("optimal_token_baseline", [[0.0, 1.0], [1.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]], [[0.5], [0.25]],
                  is_weights=T([[2.0, 2.0], [1.0, 1.0]]))
    close(adv, [[0.0, 1 / 3], [0.0, -2 / 3]])


def test_optimal_token_baseline_zero_tail_and_lone_response():
    # lengths 2 and 1, w .5 everywhere: G0 = [1, 1] (r0 = [0, 1]), G1 = [2, -] (r1 = [2, 0])
    # B_0 = (1*.5 + 2*.5)/1 = 1.5; position 1 lies past the second-longest response: baseline 0 for row 0
    adv, _ = _otb("optimal_token_baseline", [[0.0, 1.0], [2.0, 0.0]], [[1.0, 1.0], [1.0, 0.0]], [[0.5], [0.5]])
    close(adv, [[-0.5, 1.0], [0.5, 0.0]])
    adv, _ = _otb("optimal_token_baseline", [[0.0, 1.0], [2.0, 0.0]], [[1.0, 1.0], [1.0, 0.0]], [[0.5], [0.5]],
                  index=("a", "b"))
    close(adv, [[1.0, 1.0], [2.0, 0.0]])  # groups of one keep their returns


def test_tir_optimal_token_baseline_lines_up_valid_tokens():
    # row 0 mask [1, 0, 1] (a tool-output hole), r [0, 0, 1] -> G at its valid tokens [1, 1]; row 1 mask [1, 1, 0],
    # r [0, 3, 0] -> G [3, 3]. w .5: TIR compares k-th valid tokens: W [.5, 1] for both, B = [2, 2] ->
    # row 0 [-1, -, -1], row 1 [1, 1, -]. Plain OTB compares positions: position 1 sees only row 1 (B 3),
    # position 2 only row 0 (B 1) -> row 0 [-1, 0, 0], row 1 [1, 0, 0].
    args = ([[0.0, 0.0, 1.0], [0.0, 3.0, 0.0]], [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]], [[0.5], [0.5]])
    adv, _ = _otb("tir_optimal_token_baseline", *args)
    close(adv, [[-1.0, 0.0, -1.0], [1.0, 1.0, 0.0]])
    adv, _ = _otb("optimal_token_baseline", *args)
    close(adv, [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])


def test_sapo_soft_gate():
    # gate f(r) = sigmoid(tau (r - 1)) * 4 / tau. A=+1, r=1, tau 1: 2 -> loss -2, grad -A*4*s(1-s)*r = -1
    # A=-1, r=e^.1, tau 1.05: sigmoid(1.05 * .105171) * 4/1.05 = 2.009826 -> loss +2.009826
    # always seq-mean-token-mean: (-2 + 2.009826) / 2 = .004913
    loss, m, grad = _pl("sapo", T([[0.0, 0.1]]), T([[1.0, -1.0]]), mode="token-sum")
    close(loss, 0.004913)
    close(grad[0, 0], -0.5)
    close(m["actor/pg_clipfrac"], 0.0)
    with pytest.raises(ConfigError, match="tau_neg"):
        _pl("sapo", T([[0.0]]), T([[1.0]]), tau_neg=0.0)


def test_geo_mean_sequence_geometric_ratio():
    # clip .2. row 0, A +1, lr [.1, .3] -> pessimistic [.1, .2] -> ratio e^.15 = 1.161834, loss -1.161834
    # row 1, A -1, lr [-.3, 0] -> [-.2, 0] -> ratio e^-.1 = .904837, loss +.904837; mean over sequences -.128498
    # clipped: row 0 token 1 (A > 0) and row 1 token 0 (A < 0) -> clipfrac 1/4, lower 1/4
    lr, adv = T([[0.1, 0.3], [-0.3, 0.0]]), T([[1.0, 1.0], [-1.0, -1.0]])
    loss, m, _ = _pl("geo_mean", lr, adv, mode="token-mean")
    close(loss, -0.128498)
    close(m["actor/pg_clipfrac"], 0.25)
    close(m["actor/pg_clipfrac_lower"], 0.25)
    # IS weights become per-sequence geometric means: row 0 [2, .5] -> 1, row 1 [4, 1] -> 2: (-1.161834 + 1.809675)/2
    old = torch.full_like(lr, -1.0)
    loss, _ = policy_loss("geo_mean", old_log_prob_BT=old, log_prob_BT=old + lr, advantages_BT=adv,
                          response_mask_BT=torch.ones_like(lr), loss_agg_mode="token-mean", cfg=LossKnobs(),
                          rollout_is_weights_BT=T([[2.0, 0.5], [4.0, 1.0]]))
    close(loss, 0.323920)


def test_cispo_clips_the_weight_not_the_gradient():
    # A +1, r 1.5 -> sg(1.2) * ...: loss -1.2 * logp = -1.2 * (-1 + ln 1.5) = .713442, grad -1.2
    # A -1, r .5  -> sg(.8): loss .8 * logp = .8 * (-1 + ln .5) = -1.354518, grad .8; token-mean halves both
    loss, m, grad = _pl("cispo", T([[math.log(1.5), math.log(0.5)]]), T([[1.0, -1.0]]))
    close(loss, -0.320538)
    close(grad, [[-0.6, 0.4]])
    close(m["actor/pg_clipfrac"], 1.0)


def test_dro_quadratic_penalty():
    # beta .1, old -1, lr [.2, -.4] -> logp [-.8, -1.4], A [1, -1]
    # loss -(A logp - .05 lr^2) = [.802, -1.392] -> token-mean -.295; grad -(A - beta lr) / 2 = [-.49, .48]
    loss, _, grad = _pl("dro", T([[0.2, -0.4]]), T([[1.0, -1.0]]))
    close(loss, -0.295)
    close(grad, [[-0.49, 0.48]])
    with pytest.raises(ConfigError, match="dro_beta=0.0"):
        _pl("dro", T([[0.0]]), T([[1.0]]), dro_beta=0.0)


def test_dppo_tv_and_kl_trust_regions():
    # four tokens, old logp -1 (p .367879), clip .2 (TV / binary-KL thresholds here), clip_ratio_c 3:
    #   A +1, r 2:  p .735759, dp .3679 > .2 -> out;   A +1, r 1.2: dp .0736 -> in: -1.2 * logp(-.817678) = .981214
    #   A -1, r .5: dp -.1839 -> in: .5 * logp(-1.693147) = -.846574;   A -1, r .3: dp -.2575 -> out
    # token-mean (.981214 - .846574) / 4 = .033660; 2 of 4 outside. Binary KL agrees here: .296, .011, .094, .227
    lr, adv = T([[math.log(2.0), math.log(1.2), math.log(0.5), math.log(0.3)]]), T([[1.0, 1.0, -1.0, -1.0]])
    for name in ("dppo_tv", "dppo_kl"):
        loss, m, grad = _pl(name, lr, adv)
        close(loss, 0.033660)
        close(m["actor/pg_clipfrac"], 0.5)
        close(grad, [[0.0, -0.3, 0.125, 0.0]])  # -A * sg(r) / 4 inside the region
    # where they differ: old logp -.1 (p .904837), r 1.1 (p .995321): TV dp .0905 <= .15, binary KL .2004 > .15
    # TV loss -1.1 * logp(-.1 + ln 1.1) = .005159; KL drops the token
    old = T([[-0.1]])
    tv, m_tv, _ = _pl("dppo_tv", T([[math.log(1.1)]]), T([[1.0]]), old=old, clip_ratio=0.15)
    kl, m_kl, _ = _pl("dppo_kl", T([[math.log(1.1)]]), T([[1.0]]), old=old, clip_ratio=0.15)
    close(tv, 0.005159)
    close(kl, 0.0)
    close(m_tv["actor/pg_clipfrac"], 0.0)
    close(m_kl["actor/pg_clipfrac"], 1.0)


@pytest.mark.parametrize("name", ["sapo", "geo_mean", "cispo", "dro", "dppo_tv", "dppo_kl"])
def test_new_policy_losses_micro_batch_invariance(name):
    test_policy_loss_gradient_micro_batch_invariance(name, "token-mean")


@pytest.mark.parametrize("name", ["grpo_passk", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"])
def test_new_estimators_follow_a_row_permutation(name):
    """Shuffling the rows (groups and all) shuffles the advantages the same way: no estimator reads row order."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(8, 5, generator=g) > 0.2).float()
    mask[:, 0] = 1.0
    r = torch.randint(0, 3, (8, 5), generator=g).float() * mask
    kw = dict(old_log_probs_BT=-torch.rand(8, 5, generator=g), sum_pi_squared_BT=torch.rand(8, 5, generator=g),
              reward_components_KB=torch.rand(2, 8, generator=g))
    index = np.array(list("aabbbccd"))
    if name == "grpo_passk":
        index = np.array(list("aabbbccc"))  # pass@k needs two responses per group
    perm = torch.randperm(8, generator=g)
    adv, ret = compute_advantage(name, token_level_rewards_BT=r, response_mask_BT=mask, index=index, **kw)
    kw_p = dict(old_log_probs_BT=kw["old_log_probs_BT"][perm], sum_pi_squared_BT=kw["sum_pi_squared_BT"][perm],
                reward_components_KB=kw["reward_components_KB"][:, perm])
    adv_p, ret_p = compute_advantage(name, token_level_rewards_BT=r[perm], response_mask_BT=mask[perm],
                                     index=index[perm.numpy()], **kw_p)
    close(adv_p, adv[perm])
    close(ret_p, ret[perm])
