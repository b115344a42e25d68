"""FlowGRPO's advantage and loss, built on the shared `polyrl.algorithms` functions.

- Advantage: the shared `compute_advantage("grpo", ...)`: (R - group mean) [/ std], with FlowGRPO's `global_std`
  (divide by the std of the whole batch instead, the default for SD3/Qwen in both upstream repos) and
  `adv_clip_max` (clip to [-c, c]). Std is the unbiased torch.std (as verl's grpo and verl-omni's flow_grpo);
  flow_grpo uses numpy's biased std, a factor sqrt(n/(n-1)).
- Loss: each (sample, trained step) pair is one "token" of the shared `policy_loss("vanilla")` with
  token-mean aggregation, so the normaliser is the mini-batch's sample x step count whatever the micro-batch split.
  The dual clip is disabled (clip_ratio_c huge): FlowGRPO has none. Clip fractions are verl-omni's FlowGRPO ones,
  on the ratio alone: `pg_clipfrac_higher` = share of ratios above 1 + clip, `pg_clipfrac_lower` = below 1 - clip
  (their sum is verl-omni's `pg_clipfrac`, |ratio - 1| > clip), whatever the advantage's sign.
"""

from __future__ import annotations

import torch

from polyrl.algorithms.advantages import compute_advantage
from polyrl.algorithms.losses import LossKnobs, agg_loss, policy_loss

ADV_EPS = 1e-4  # flow_grpo's epsilon in (R - mean) / (std + eps)


def flow_grpo_advantages(
    scores_B: torch.Tensor,
    index,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    global_std: bool = True,
    adv_clip_max: float = 5.0,
) -> torch.Tensor:
    """Outcome advantages [B] per prompt group (`index`: one group id per sample)."""
    scores_BT = scores_B.float().unsqueeze(-1)
    adv_BT, _ = compute_advantage(
        "grpo", token_level_rewards_BT=scores_BT, response_mask_BT=torch.ones_like(scores_BT), index=index,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, global_std=global_std, adv_clip_max=adv_clip_max,
        epsilon=ADV_EPS,
    )  # fmt: skip
    return adv_BT[:, 0]


def zero_std_ratio(scores_B: torch.Tensor, index) -> float:
    """Fraction of prompt groups whose rewards are all equal (their advantages are 0: no learning signal)."""
    groups: dict = {}
    for s, g in zip(scores_B.tolist(), list(index)):
        groups.setdefault(g, []).append(s)
    return sum(max(v) - min(v) < 1e-8 for v in groups.values()) / max(len(groups), 1)


def clipped_loss(
    log_prob_B: torch.Tensor,
    old_log_prob_B: torch.Tensor,
    adv_B: torch.Tensor,
    *,
    clip_ratio: float,
    num_terms: int,
    kl_B: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    is_weights_B: torch.Tensor | None = None,
    mask_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip loss of one micro-batch at one trained step, normalised by `num_terms` (= samples x steps of the
    whole mini-batch), so summing the micro-batch losses gives the mini-batch mean. Metrics are detached sums
    over this micro-batch's terms (divide by `num_terms` to get means). Rollout correction (polyrl/algorithms/
    rollout_correction.py) enters as `is_weights_B` (truncated IS weights on the per-sample loss) and `mask_B`
    (0 for rejected samples), exactly as the LLM's per-token ones do."""
    lp_BT, old_BT, adv_BT = log_prob_B.unsqueeze(-1), old_log_prob_B.unsqueeze(-1), adv_B.unsqueeze(-1)
    mask_BT = torch.ones_like(lp_BT) if mask_B is None else mask_B.to(lp_BT).unsqueeze(-1)
    cfg = LossKnobs(clip_ratio=clip_ratio, clip_ratio_c=1e30)
    pg_loss, _ = policy_loss(
        "vanilla", old_log_prob_BT=old_BT, log_prob_BT=lp_BT, advantages_BT=adv_BT, response_mask_BT=mask_BT,
        loss_agg_mode="token-mean", cfg=cfg, num_tokens=num_terms,
        rollout_is_weights_BT=None if is_weights_B is None else is_weights_B.to(lp_BT).unsqueeze(-1),
    )  # fmt: skip
    loss = pg_loss
    with torch.no_grad():
        ratio_B = torch.exp(log_prob_B - old_log_prob_B)
        metrics = {
            "actor/pg_loss": pg_loss.detach() * num_terms,  # sum over this micro-batch's terms
            "actor/ratio_mean": ratio_B.sum(),
            "actor/ppo_kl": (old_log_prob_B - log_prob_B).sum(),
            "actor/pg_clipfrac_higher": (ratio_B > 1 + clip_ratio).float().sum(),
            "actor/pg_clipfrac_lower": (ratio_B < 1 - clip_ratio).float().sum(),
        }
    if kl_B is not None:
        kl_loss = agg_loss(kl_B.unsqueeze(-1), mask_BT, "token-mean", num_tokens=num_terms)
        loss = loss + kl_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach() * num_terms
    return loss, metrics
