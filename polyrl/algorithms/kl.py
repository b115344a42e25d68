"""KL estimators between the policy and the reference, KL controllers, and the KL-in-reward penalty (verl's).

Estimators (http://joschu.net/blog/kl-approx.html), with d = log_prob - ref_log_prob:

- `kl` / `k1`: d                       (unbiased value, biased gradient)
- `abs`: |d|
- `mse` / `k2`: 0.5 * d^2              (its gradient is the right KL gradient)
- `low_var_kl` / `k3`: exp(-d) + d - 1, clamped to [-10, 10] (low-variance, non-negative value)

A trailing `+` (e.g. `k3+`) keeps the value of that estimator but takes the gradient of k2 (straight-through),
as verl does. `full` (the exact KL over the vocabulary) needs full logits and is not supported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from polyrl.algorithms.masked import masked_mean
from polyrl.errors import ConfigError

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


def _abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


def _k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


def _k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    log_ratio = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)  # keeps exp() finite
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)


KL_ESTIMATORS: dict[str, KLFn] = {
    "kl": _k1, "k1": _k1, "abs": _abs, "mse": _k2, "k2": _k2, "low_var_kl": _k3, "k3": _k3,
}  # fmt: skip


_KL_KEYS = "algorithm.kl_penalty / actor_rollout_ref.actor.kl_loss_type"


def check_kl_kind(kind: str, key: str = _KL_KEYS) -> None:
    """Raise ConfigError (naming `key`) unless `kind` is a known estimator, optionally with a trailing '+'."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base == "full":
        raise ConfigError(
            f"KL estimator {kind!r} ({key}): the full-vocabulary KL is not supported; use low_var_kl (k3) instead."
        )
    if base not in KL_ESTIMATORS:
        raise ConfigError(
            f"KL estimator {kind!r} ({key}) is not known; use one of {sorted(KL_ESTIMATORS)}, optionally with a '+'."
        )


def kl_penalty(kind: str, log_prob_BT: torch.Tensor, ref_log_prob_BT: torch.Tensor) -> torch.Tensor:
    """Per-token KL estimate of kind `kind`; a trailing '+' swaps in the k2 gradient (straight-through)."""
    check_kl_kind(kind)
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    value_BT = KL_ESTIMATORS[base](log_prob_BT, ref_log_prob_BT)
    if not straight_through or KL_ESTIMATORS[base] is _k2:
        return value_BT
    grad_BT = _k2(log_prob_BT, ref_log_prob_BT)
    return grad_BT - grad_BT.detach() + value_BT.detach()


# --------------------------------------------------------------------------- controllers


@dataclass
class FixedKLController:
    """KL coefficient that never changes (algorithm.kl_ctrl.type=fixed)."""

    kl_coef: float = 0.001
    """The coefficient beta."""
    value: float = field(init=False)

    def __post_init__(self):
        self.value = self.kl_coef

    def update(self, current_kl, n_steps: int) -> None:
        """No-op: a fixed coefficient."""


@dataclass
class AdaptiveKLController:
    """Ziegler et al. (2019) controller: beta *= 1 + clip(kl / target - 1, +-0.2) * n_steps / horizon."""

    kl_coef: float = 0.001
    """Initial coefficient beta."""
    target_kl: float = 0.1
    """KL the controller steers towards."""
    horizon: int = 10000
    """Samples over which a full proportional correction is applied; must be > 0."""
    value: float = field(init=False)

    def __post_init__(self):
        if self.horizon <= 0:
            raise ConfigError(f"algorithm.kl_ctrl.horizon={self.horizon} must be > 0 for the adaptive KL controller.")
        self.value = self.kl_coef

    def update(self, current_kl, n_steps: int) -> None:
        """Move beta towards the target given the batch's mean KL and its number of samples."""
        error = min(max(float(current_kl) / self.target_kl - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


KL_CONTROLLERS: dict[str, Callable[..., FixedKLController | AdaptiveKLController]] = {
    "fixed": lambda kl_coef, target_kl, horizon: FixedKLController(kl_coef=kl_coef),
    "adaptive": lambda kl_coef, target_kl, horizon: AdaptiveKLController(kl_coef, target_kl, horizon),
}
"""algorithm.kl_ctrl.type -> build(kl_coef, target_kl, horizon)."""


def make_kl_controller(
    type: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by algorithm.kl_ctrl.type."""
    if type not in KL_CONTROLLERS:
        raise ConfigError(f"algorithm.kl_ctrl.type={type!r} is not supported; use one of {sorted(KL_CONTROLLERS)}.")
    return KL_CONTROLLERS[type](kl_coef, target_kl, horizon)


def apply_kl_in_reward(
    token_level_scores_BT: torch.Tensor,
    old_log_prob_BT: torch.Tensor,
    ref_log_prob_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """rewards = scores - beta * KL per token; updates `kl_ctrl` with the batch's mean per-sequence KL."""
    mask_BT = response_mask_BT.to(token_level_scores_BT.dtype)
    with torch.no_grad():
        kl_BT = kl_penalty(kind, old_log_prob_BT, ref_log_prob_BT) * mask_BT
        beta = kl_ctrl.value
        rewards_BT = token_level_scores_BT - beta * kl_BT
        current_kl = masked_mean(kl_BT, mask_BT, dim=-1).mean()  # mean over sequences of each one's token mean
    kl_ctrl.update(current_kl, n_steps=token_level_scores_BT.shape[0])
    metrics = {
        "actor/reward_kl_penalty": current_kl,
        "actor/reward_kl_penalty_coeff": torch.tensor(beta, dtype=torch.float32),
    }
    return rewards_BT, metrics
