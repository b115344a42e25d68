"""Advantage estimators: pure functions of rewards, masks, group ids (and values for GAE), in a registry.

Semantics follow verl's `core_algos.py` (the key `algorithm.adv_estimator` picks one by name):

- `gae`: GAE over response tokens, skipping padding; advantages whitened over the batch, returns = adv + values.
- `grpo`: outcome score s = sum of token rewards; per group (s - mean) / (std + eps) with torch.std (unbiased);
  a group of one gets mean 0, std 1. Dr.GRPO is `norm_adv_by_std_in_grpo=False` (no division). FlowGRPO's
  `global_std=True` divides by the std of the whole batch's scores instead of each group's.
- `rloo`: n/(n-1) * (s - group mean), i.e. s minus the mean of the *other* samples; a group of one keeps s
  (verl's `rloo` does the same; its `rloo_vectorized`, also registered here, gives such a row 0 instead).
  `grpo_vectorized` is `grpo` (verl's two spellings of the same math).
- `reinforce_plus_plus`: discounted return-to-go (gamma), whitened over all valid tokens of the batch; masked
  positions inside a response (tool output, multi-turn gaps) carry the running return across unchanged and have
  return 0 (verl 0.9.1).
- `reinforce_plus_plus_baseline`: s minus the group mean, broadcast to tokens, whitened over the batch.
- `remax`: return-to-go minus the greedy rollout's reward `reward_baselines_B`.
- `opo`: s minus the length-weighted group mean sum(len * s) / sum(len).
- `gpg`: B / (number of nonzero scores) * (s - group mean).
- `grpo_passk` (arXiv:2503.19595): only each group's best response gets an advantage, r_max - r_second_max (divided
  by the group's std + eps unless Dr.GRPO); groups need at least 2 responses.
- `gdpo` (arXiv:2601.05242): GRPO on each reward component separately (`reward_components_KB`, from the reward
  function's extra keys `algorithm.gdpo_reward_keys`), weighted sum (`gdpo_reward_weights`), whitened over the batch.
- `optimal_token_baseline` (OTB, verl docs/algo/otb.md): per group and position t, the baseline
  B_t = sum_i G_it W_it / sum_i W_it with G the return-to-go and W_t = sum_{j<=t} (1 - 2 pi_j + sum_v pi_v^2) the
  cumulative path-variance proxy (needs `old_log_probs_BT` and `sum_pi_squared_BT`; rollout IS weights scale w by
  rho^2); the longest response of a group gets baseline 0 past the second longest. `tir_optimal_token_baseline`
  does the same on each response's valid tokens packed to the left (tool-integrated rollouts with mask holes).

Group statistics are computed with scatter-adds instead of verl's per-row Python loop (same values to float
rounding); padding positions of every advantage are 0. `adv_clip_max` (FlowGRPO, any estimator) clips the
advantages, not the returns, to [-adv_clip_max, adv_clip_max].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from polyrl.algorithms.masked import masked_whiten
from polyrl.errors import ConfigError


@dataclass(frozen=True)
class _Estimator:
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    needs: tuple[str, ...]


ADV_ESTIMATORS: dict[str, _Estimator] = {}

# What each optional input is called in the user's world, for error messages.
_INPUT_HINTS = {
    "index": "group ids (one per row, rows of the same prompt share one; rollout.n > 1)",
    "values_BT": "critic values (enable the critic: critic.enable=True)",
    "reward_baselines_B": "greedy-rollout rewards (ReMax generates one greedy response per prompt)",
    "old_log_probs_BT": "old log-probs (the trainer computes them when the estimator needs them)",
    "sum_pi_squared_BT": "the sum of squared token probabilities over the vocabulary per position",
}


def register_adv_est(name: str, needs: Sequence[str] = ()):
    """Register `fn(**inputs) -> (advantages_BT, returns_BT)` under `name`; `needs` lists required optional inputs."""

    def decorator(fn):
        if name in ADV_ESTIMATORS and ADV_ESTIMATORS[name].fn is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered; pick another name")
        ADV_ESTIMATORS[name] = _Estimator(fn, tuple(needs))
        return fn

    return decorator


def compute_advantage(
    name: str,
    *,
    token_level_rewards_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    index: Sequence | np.ndarray | None = None,
    values_BT: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    reward_baselines_B: torch.Tensor | None = None,
    global_std: bool = False,
    adv_clip_max: float | None = None,
    old_log_probs_BT: torch.Tensor | None = None,
    sum_pi_squared_BT: torch.Tensor | None = None,
    rollout_is_weights_BT: torch.Tensor | None = None,
    reward_components_KB: torch.Tensor | None = None,
    reward_weights_K: Sequence[float] | None = None,
    whiten: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = masked_whiten,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ([B, T] each) from the estimator registered as `name`; advantages clipped to
    [-adv_clip_max, adv_clip_max] when it is given. `whiten`: the batch whitening of the estimators that whiten
    (gae, reinforce_plus_plus(_baseline), gdpo); with several processes, `masked.whiten_over` the whole job's batch."""
    if name not in ADV_ESTIMATORS:
        raise ConfigError(
            f"algorithm.adv_estimator={name!r} is not a known advantage estimator; use one of {sorted(ADV_ESTIMATORS)}."
        )
    estimator = ADV_ESTIMATORS[name]
    inputs = dict(index=index, values_BT=values_BT, reward_baselines_B=reward_baselines_B,
                  old_log_probs_BT=old_log_probs_BT, sum_pi_squared_BT=sum_pi_squared_BT)
    for need in estimator.needs:
        if inputs[need] is None:
            raise ConfigError(f"algorithm.adv_estimator={name!r} needs {_INPUT_HINTS[need]}, but none were given.")
    if index is not None and len(index) != token_level_rewards_BT.shape[0]:
        raise ValueError(f"index has {len(index)} entries but the batch has {token_level_rewards_BT.shape[0]} rows")
    mask_BT = response_mask_BT.to(token_level_rewards_BT.dtype)
    with torch.no_grad():
        advantages_BT, returns_BT = estimator.fn(
            token_level_rewards_BT=token_level_rewards_BT,
            response_mask_BT=mask_BT,
            index=index,
            values_BT=values_BT,
            gamma=gamma,
            lam=lam,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
            epsilon=epsilon,
            reward_baselines_B=reward_baselines_B,
            global_std=global_std,
            old_log_probs_BT=old_log_probs_BT,
            sum_pi_squared_BT=sum_pi_squared_BT,
            rollout_is_weights_BT=rollout_is_weights_BT,
            reward_components_KB=reward_components_KB,
            reward_weights_K=reward_weights_K,
            whiten=whiten,
        )
        if adv_clip_max is not None:
            advantages_BT = advantages_BT.clamp(-adv_clip_max, adv_clip_max)
        return advantages_BT, returns_BT


# --------------------------------------------------------------------------- group statistics


def group_ids(index: Sequence | np.ndarray, device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids (ints, strings, uuids) to 0..G-1; returns (ids_B, G)."""
    _, inverse = np.unique(np.asarray(index), return_inverse=True)
    ids_B = torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)
    return ids_B, int(inverse.max()) + 1 if inverse.size else 0


def group_mean_std(scores_B: torch.Tensor, ids_B: torch.Tensor, num_groups: int):
    """Per-row group mean and unbiased std; groups of one get mean 0, std 1 (as verl). Also returns sizes."""
    count_G = torch.zeros(num_groups, dtype=scores_B.dtype, device=scores_B.device).index_add_(
        0, ids_B, torch.ones_like(scores_B)
    )
    mean_G = torch.zeros_like(count_G).index_add_(0, ids_B, scores_B) / count_G
    sq_dev_G = torch.zeros_like(count_G).index_add_(0, ids_B, (scores_B - mean_G[ids_B]) ** 2)
    std_G = torch.sqrt(sq_dev_G / (count_G - 1).clamp_min(1))
    multi_G = count_G > 1
    mean_G = torch.where(multi_G, mean_G, torch.zeros_like(mean_G))
    std_G = torch.where(multi_G, std_G, torch.ones_like(std_G))
    return mean_G[ids_B], std_G[ids_B], count_G[ids_B]


def _outcome_scores(token_level_rewards_BT: torch.Tensor, index) -> tuple[torch.Tensor, torch.Tensor, int]:
    scores_B = token_level_rewards_BT.sum(dim=-1)
    ids_B, num_groups = group_ids(index, scores_B.device)
    return scores_B, ids_B, num_groups


# --------------------------------------------------------------------------- estimators


@register_adv_est("gae", needs=("values_BT",))
def gae(*, token_level_rewards_BT, values_BT, response_mask_BT, gamma, lam, whiten=masked_whiten, **_):
    """Generalized advantage estimation; padding tokens carry the next value and GAE through unchanged."""
    next_value_B = torch.zeros_like(token_level_rewards_BT[:, 0])
    last_gae_B = torch.zeros_like(next_value_B)
    advantages = []
    for t in reversed(range(token_level_rewards_BT.shape[1])):
        mask_B = response_mask_BT[:, t]
        delta_B = token_level_rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        gae_B = delta_B + gamma * lam * last_gae_B
        next_value_B = values_BT[:, t] * mask_B + (1 - mask_B) * next_value_B
        last_gae_B = gae_B * mask_B + (1 - mask_B) * last_gae_B
        advantages.append(last_gae_B)
    advantages_BT = torch.stack(advantages[::-1], dim=1)
    returns_BT = advantages_BT + values_BT
    return whiten(advantages_BT, response_mask_BT) * response_mask_BT, returns_BT


@register_adv_est("grpo_vectorized", needs=("index",))  # verl's second spelling of the same math
@register_adv_est("grpo", needs=("index",))
def grpo(*, token_level_rewards_BT, response_mask_BT, index, norm_adv_by_std_in_grpo, epsilon, global_std=False, **_):
    """Group-relative advantage; Dr.GRPO skips the division by the std; `global_std` uses the batch's std."""
    scores_B, ids_B, num_groups = _outcome_scores(token_level_rewards_BT, index)
    mean_B, std_B, _ = group_mean_std(scores_B, ids_B, num_groups)
    adv_B = scores_B - mean_B
    if norm_adv_by_std_in_grpo:
        if global_std:  # a batch of one has no spread: std 1, as a group of one
            std_B = (scores_B.std() if scores_B.numel() > 1 else torch.ones_like(scores_B[0])).expand_as(scores_B)
        adv_B = adv_B / (std_B + epsilon)
    adv_BT = adv_B.unsqueeze(-1) * response_mask_BT
    return adv_BT, adv_BT


@register_adv_est("rloo", needs=("index",))
def rloo(*, token_level_rewards_BT, response_mask_BT, index, **_):
    """Leave-one-out baseline: n/(n-1) * (s - mean) == s - mean(others). A group of one keeps its raw score: verl's
    two RLOO implementations disagree there (`rloo`: raw score, `rloo_vectorized`: 0); we follow `rloo`, whose name
    users select, and because a lone sample's reward is still a (baseline-free) REINFORCE signal."""
    scores_B, ids_B, num_groups = _outcome_scores(token_level_rewards_BT, index)
    mean_B, _, count_B = group_mean_std(scores_B, ids_B, num_groups)
    loo_B = (scores_B - mean_B) * count_B / (count_B - 1).clamp_min(1)
    adv_B = torch.where(count_B > 1, loo_B, scores_B)
    adv_BT = adv_B.unsqueeze(-1) * response_mask_BT
    return adv_BT, adv_BT


@register_adv_est("rloo_vectorized", needs=("index",))
def rloo_vectorized(*, token_level_rewards_BT, response_mask_BT, index, **_):
    """verl's `rloo_vectorized`: `rloo` except that a group of one gets advantage 0 instead of its raw score."""
    scores_B, ids_B, num_groups = _outcome_scores(token_level_rewards_BT, index)
    _, _, count_B = group_mean_std(scores_B, ids_B, num_groups)
    adv_BT, _ = rloo(token_level_rewards_BT=token_level_rewards_BT, response_mask_BT=response_mask_BT, index=index)
    adv_BT = adv_BT * (count_B > 1).unsqueeze(-1)
    return adv_BT, adv_BT


@register_adv_est("reinforce_plus_plus")
def reinforce_plus_plus(*, token_level_rewards_BT, response_mask_BT, gamma, whiten=masked_whiten, **_):
    """Discounted return-to-go over valid tokens only: a masked position neither discounts nor adds its reward, it
    carries the running return across and gets return 0 (verl 0.9.1); whitened over all valid tokens of the batch."""
    returns_BT = torch.zeros_like(token_level_rewards_BT)
    running_B = torch.zeros_like(token_level_rewards_BT[:, 0])
    for t in reversed(range(token_level_rewards_BT.shape[1])):
        valid_B = response_mask_BT[:, t] > 0
        running_B = torch.where(valid_B, token_level_rewards_BT[:, t] + gamma * running_B, running_B)
        returns_BT[:, t] = running_B * response_mask_BT[:, t]
    advantages_BT = whiten(returns_BT, response_mask_BT) * response_mask_BT
    return advantages_BT, returns_BT


@register_adv_est("reinforce_plus_plus_baseline", needs=("index",))
def reinforce_plus_plus_baseline(*, token_level_rewards_BT, response_mask_BT, index, whiten=masked_whiten, **_):
    """Score minus group mean (a group of one: mean 0), broadcast to tokens, whitened over the batch's tokens."""
    scores_B, ids_B, num_groups = _outcome_scores(token_level_rewards_BT, index)
    mean_B, _, _ = group_mean_std(scores_B, ids_B, num_groups)
    adv_BT = (scores_B - mean_B).unsqueeze(-1) * response_mask_BT
    adv_BT = whiten(adv_BT, response_mask_BT) * response_mask_BT
    return adv_BT, adv_BT


@register_adv_est("remax", needs=("reward_baselines_B",))
def remax(*, token_level_rewards_BT, response_mask_BT, reward_baselines_B, **_):
    """Return-to-go minus the greedy response's reward (the ReMax baseline)."""
    returns_BT = (token_level_rewards_BT * response_mask_BT).flip(-1).cumsum(-1).flip(-1)
    baselines_B = torch.as_tensor(reward_baselines_B, dtype=returns_BT.dtype, device=returns_BT.device)
    advantages_BT = returns_BT - baselines_B.unsqueeze(-1) * response_mask_BT
    return advantages_BT, returns_BT


@register_adv_est("opo", needs=("index",))
def opo(*, token_level_rewards_BT, response_mask_BT, index, **_):
    """Score minus the length-weighted group mean; a group of one has baseline 0."""
    scores_B, ids_B, num_groups = _outcome_scores(token_level_rewards_BT, index)
    lengths_B = response_mask_BT.sum(dim=-1)
    _, _, count_B = group_mean_std(scores_B, ids_B, num_groups)
    zeros_G = torch.zeros(num_groups, dtype=scores_B.dtype, device=scores_B.device)
    weighted_G = zeros_G.index_add(0, ids_B, lengths_B * scores_B)
    length_G = zeros_G.index_add(0, ids_B, lengths_B)
    baseline_B = torch.where(count_B > 1, weighted_G[ids_B] / length_G[ids_B].clamp_min(1e-8), 0.0)
    adv_BT = (scores_B - baseline_B).unsqueeze(-1) * response_mask_BT
    return adv_BT, adv_BT


@register_adv_est("gpg", needs=("index",))
def gpg(*, token_level_rewards_BT, response_mask_BT, index, **_):
    """Group-mean baseline scaled by B / #nonzero scores (GPG's alpha; f_norm = 1 as in verl)."""
    scores_B, ids_B, num_groups = _outcome_scores(token_level_rewards_BT, index)
    mean_B, _, _ = group_mean_std(scores_B, ids_B, num_groups)
    alpha = scores_B.shape[0] / torch.count_nonzero(scores_B).clamp(min=1)
    adv_BT = (alpha * (scores_B - mean_B)).unsqueeze(-1) * response_mask_BT
    return adv_BT, adv_BT


@register_adv_est("grpo_passk", needs=("index",))
def grpo_passk(*, token_level_rewards_BT, response_mask_BT, index, norm_adv_by_std_in_grpo, epsilon, **_):
    """Pass@k GRPO (verl `compute_grpo_passk_outcome_advantage`): the best response of each group gets
    r_max - r_second_max (over std + eps when norm_adv_by_std_in_grpo), every other response 0. Ties at the top give 0
    whichever row holds the max, so which tied row verl's topk picks does not matter."""
    scores_B, ids_B, num_groups = _outcome_scores(token_level_rewards_BT, index)
    _, std_B, count_B = group_mean_std(scores_B, ids_B, num_groups)
    if bool((count_B < 2).any()):
        raise ConfigError("algorithm.adv_estimator=grpo_passk needs at least 2 responses per prompt; set "
                          "actor_rollout_ref.rollout.n >= 2.")
    rows_B = torch.arange(len(scores_B), device=scores_B.device)
    max_G = torch.full((num_groups,), -torch.inf, dtype=scores_B.dtype, device=scores_B.device)
    max_G = max_G.scatter_reduce(0, ids_B, scores_B, "amax")
    is_max_B = scores_B == max_G[ids_B]
    first_G = torch.full((num_groups,), len(scores_B), device=scores_B.device).scatter_reduce(
        0, ids_B, torch.where(is_max_B, rows_B, len(scores_B)), "amin")
    num_max_G = torch.zeros(num_groups, device=scores_B.device).index_add(0, ids_B, is_max_B.float())
    below_G = torch.full_like(max_G, -torch.inf).scatter_reduce(
        0, ids_B, torch.where(is_max_B, -torch.inf, scores_B), "amax")
    second_G = torch.where(num_max_G > 1, max_G, below_G)
    gap_B = (max_G - second_G)[ids_B]
    if norm_adv_by_std_in_grpo:
        gap_B = gap_B / (std_B + epsilon)
    adv_B = torch.where(rows_B == first_G[ids_B], gap_B, torch.zeros_like(gap_B))
    adv_BT = adv_B.unsqueeze(-1) * response_mask_BT
    return adv_BT, adv_BT


@register_adv_est("gdpo", needs=("index",))
def gdpo(*, token_level_rewards_BT, response_mask_BT, index, norm_adv_by_std_in_grpo, epsilon,
         reward_components_KB=None, reward_weights_K=None, whiten=masked_whiten, **_):
    """GDPO (arXiv:2601.05242; verl `compute_gdpo_outcome_advantage`): GRPO-normalise each reward component within
    its group, sum with weights (default 1 each), whiten over the batch's valid tokens. Without components it is GRPO
    on the total score followed by the batch whitening (verl's fallback)."""
    scores_KB = token_level_rewards_BT.sum(-1, keepdim=True).T if reward_components_KB is None else \
        torch.as_tensor(reward_components_KB, dtype=token_level_rewards_BT.dtype, device=token_level_rewards_BT.device)
    weights_K = torch.ones(scores_KB.shape[0]) if reward_weights_K is None else torch.as_tensor(reward_weights_K)
    if len(weights_K) != scores_KB.shape[0]:
        raise ConfigError(f"algorithm.gdpo_reward_weights has {len(weights_K)} values for {scores_KB.shape[0]} "
                          "algorithm.gdpo_reward_keys; give one weight per key.")
    ids_B, num_groups = group_ids(index, scores_KB.device)
    total_B = torch.zeros_like(scores_KB[0])
    for scores_B, w in zip(scores_KB, weights_K.tolist()):
        mean_B, std_B, _ = group_mean_std(scores_B, ids_B, num_groups)
        adv_B = scores_B - mean_B
        total_B = total_B + w * (adv_B / (std_B + epsilon) if norm_adv_by_std_in_grpo else adv_B)
    adv_BT = total_B.unsqueeze(-1) * response_mask_BT
    adv_BT = whiten(adv_BT, response_mask_BT) * response_mask_BT
    return adv_BT, adv_BT


_OTB_EPS = 1e-8  # verl's default for both OTB estimators (the shared `epsilon` is GRPO's)


def _otb(returns_BT, w_BT, mask_BT, ids_B, num_groups):
    """OTB baseline per group and position, with the longest response's tail (past the second longest) at 0."""
    W_BT = (w_BT * mask_BT).cumsum(-1)
    zeros_GT = returns_BT.new_zeros((num_groups, returns_BT.shape[1]))
    num_GT = zeros_GT.index_add(0, ids_B, returns_BT * W_BT * mask_BT)
    den_GT = zeros_GT.index_add(0, ids_B, W_BT * mask_BT)
    baseline_BT = (num_GT / (den_GT + _OTB_EPS))[ids_B]
    count_B = returns_BT.new_zeros(num_groups).index_add(0, ids_B, torch.ones_like(ids_B, dtype=returns_BT.dtype))
    baseline_BT = baseline_BT * (count_B[ids_B] > 1).unsqueeze(-1)  # a lone response keeps its return
    len_B = mask_BT.sum(-1)
    max_G = len_B.new_zeros(num_groups).scatter_reduce(0, ids_B, len_B, "amax", include_self=False)
    is_max_B = len_B == max_G[ids_B]
    num_max_G = len_B.new_zeros(num_groups).index_add(0, ids_B, is_max_B.to(len_B.dtype))
    second_G = len_B.new_zeros(num_groups).scatter_reduce(0, ids_B, torch.where(is_max_B, 0, len_B), "amax")
    unique_longest_B = is_max_B & (num_max_G[ids_B] == 1) & (count_B[ids_B] > 1)
    cols_T = torch.arange(returns_BT.shape[1], device=returns_BT.device)
    tail_BT = unique_longest_B.unsqueeze(-1) & (cols_T >= second_G[ids_B].unsqueeze(-1))
    return baseline_BT.masked_fill(tail_BT, 0.0)


def _otb_inputs(token_level_rewards_BT, response_mask_BT, old_log_probs_BT, sum_pi_squared_BT, rollout_is_weights_BT):
    returns_BT = (token_level_rewards_BT * response_mask_BT).flip(-1).cumsum(-1).flip(-1)
    w_BT = 1 - 2 * torch.exp(old_log_probs_BT) + sum_pi_squared_BT
    if rollout_is_weights_BT is not None:  # minimises the MSE under truncated IS (verl)
        w_BT = w_BT * rollout_is_weights_BT.square()
    return returns_BT, w_BT


@register_adv_est("optimal_token_baseline", needs=("index", "old_log_probs_BT", "sum_pi_squared_BT"))
def optimal_token_baseline(*, token_level_rewards_BT, response_mask_BT, index, old_log_probs_BT, sum_pi_squared_BT,
                           rollout_is_weights_BT=None, **_):
    """OTB (verl `compute_optimal_token_baseline_advantage`, handle_zero_tail=True): A_t = G_t - B_t, per group and
    position; returns are the returns-to-go G. No whitening."""
    returns_BT, w_BT = _otb_inputs(token_level_rewards_BT, response_mask_BT, old_log_probs_BT, sum_pi_squared_BT,
                                   rollout_is_weights_BT)
    ids_B, num_groups = group_ids(index, returns_BT.device)
    baseline_BT = _otb(returns_BT, w_BT, response_mask_BT, ids_B, num_groups)
    return (returns_BT - baseline_BT) * response_mask_BT, returns_BT


@register_adv_est("tir_optimal_token_baseline", needs=("index", "old_log_probs_BT", "sum_pi_squared_BT"))
def tir_optimal_token_baseline(*, token_level_rewards_BT, response_mask_BT, index, old_log_probs_BT,
                               sum_pi_squared_BT, rollout_is_weights_BT=None, **_):
    """Tool-integrated OTB (verl `compute_multi_turn_optimal_token_baseline_advantage`): OTB over each response's
    k-th *valid* token instead of its k-th position, so responses whose masks have holes (tool outputs) line up by
    generated-token count. The valid tokens are packed left with a stable sort, OTB runs there, and the advantages go
    back to their positions."""
    returns_BT, w_BT = _otb_inputs(token_level_rewards_BT, response_mask_BT, old_log_probs_BT, sum_pi_squared_BT,
                                   rollout_is_weights_BT)
    order_BT = torch.sort((response_mask_BT <= 0).to(torch.int8), dim=-1, stable=True).indices  # valid tokens first
    packed = [x.gather(-1, order_BT) for x in (returns_BT, w_BT, response_mask_BT)]
    ids_B, num_groups = group_ids(index, returns_BT.device)
    baseline_BT = _otb(*packed, ids_B, num_groups)
    adv_packed_BT = (packed[0] - baseline_BT) * packed[2]
    advantages_BT = torch.zeros_like(returns_BT).scatter(-1, order_BT, adv_packed_BT)
    return advantages_BT * response_mask_BT, returns_BT
