"""RL algorithm math: pure tensor functions in name->function registries (verl `core_algos.py` semantics).

- `advantages`: `compute_advantage(name, ...)` over `ADV_ESTIMATORS` (gae, grpo, rloo, reinforce_plus_plus,
  reinforce_plus_plus_baseline, remax, opo, gpg, grpo_passk, gdpo, optimal_token_baseline,
  tir_optimal_token_baseline); FlowGRPO's `global_std` (grpo) and `adv_clip_max` are parameters.
- `losses`: `agg_loss` (micro-batch invariant with global normalisers), `policy_loss(name, ...)` over
  `POLICY_LOSSES` (vanilla, gspo, gpg, clip_cov, kl_cov, sapo, geo_mean, cispo, dro, dppo_tv, dppo_kl), each taking
  optional rollout IS weights, `value_loss`, logits helpers.
- `rollout_correction`: `compute_rollout_correction` (verl's `algorithm.rollout_correction.*`: truncated IS weights,
  rejection masks, `rollout_corr/*` mismatch metrics) and its `RolloutCorrectionConfig`.
- `kl`: `kl_penalty(kind, ...)`, KL controllers, `apply_kl_in_reward`.
- `dapo`: overlong penalty and dynamic-sampling group selection.
- `validation`: verl's bootstrapped val-core / val-aux metrics.
- `masked`: masked sum / mean / var / whiten.
"""

from polyrl.algorithms.advantages import ADV_ESTIMATORS, compute_advantage, group_ids, group_mean_std, register_adv_est
from polyrl.algorithms.dapo import overlong_penalty, select_groups
from polyrl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    check_kl_kind,
    kl_penalty,
    make_kl_controller,
)
from polyrl.algorithms.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    LossKnobs,
    agg_loss,
    check_loss_agg_mode,
    entropy_from_logits,
    logprobs_from_logits,
    policy_loss,
    register_policy_loss,
    value_loss,
)
from polyrl.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from polyrl.algorithms.rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from polyrl.algorithms.validation import process_validation_metrics, validation_metrics_by_source

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "LossKnobs",
    "RolloutCorrectionConfig",
    "agg_loss",
    "apply_kl_in_reward",
    "check_kl_kind",
    "check_loss_agg_mode",
    "compute_advantage",
    "compute_rollout_correction",
    "entropy_from_logits",
    "group_ids",
    "group_mean_std",
    "kl_penalty",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "process_validation_metrics",
    "register_adv_est",
    "register_policy_loss",
    "select_groups",
    "validation_metrics_by_source",
    "value_loss",
]
