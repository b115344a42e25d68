"""Rollout correction: importance weights and rejection masks between the trainer's and the rollout's log-probs.

The rollout engine samples from pi_rollout (another kernel, dtype, FP8 weights or KV, a stale checkpoint); the
trainer optimises pi_old -> pi_theta. verl's `algorithm.rollout_correction.*` keys (verl/trainer/ppo/
rollout_corr_helper.py; "When Speed Kills Stability", Liu et al. 2025) correct for the gap with two tools, both
functions of the log-ratio log(pi_old / pi_rollout) per token:

- **Importance weights** (`rollout_is`): `token` w_t = exp(lr_t); `sequence` w = exp(sum_t lr_t) on every token of
  the row. `rollout_is_threshold` is either one number (TIS: w := min(w, threshold)) or a `"lower_upper"` string
  (IcePop: w := 0 outside [lower, upper]). Log-ratios are clamped to +-20 before exp(). Weights are detached (they
  change the measure, not the objective) and multiply the per-token policy loss (`rollout_is_weights`).
  `rollout_is_batch_normalize` rescales them to mean 1 over the batch passed in (per process: no all-reduce here).
- **Rejection** (`rollout_rs`, comma-separated, all must pass): divergence statistics k1 = -lr, k2 = lr^2 / 2,
  k3 = exp(lr) - 1 - lr per token (`token_k*`), their per-sequence sum / mean / max (`seq_sum_k*`, `seq_mean_k*`,
  `seq_max_k2|3`), or `binary_kl` (KPop: max of the two Bernoulli KLs between the token probabilities). A token or
  sequence whose statistic exceeds `rollout_rs_threshold` leaves the response mask. k1 options take ratio bounds
  (`"lower_upper"`, or one upper bound u meaning [1/u, u]) compared in log space; the others one upper bound.
- **Bypass mode** (`bypass_mode=True`) is the trainer's business: old log-probs := rollout log-probs (no old-log-prob
  pass), and the correction is computed inside the update between pi_theta and pi_rollout (`loss_type` ppo_clip: the
  PPO ratio already is the IS ratio, the rejection mask applies; `reinforce`: -w * A * log pi).

Metrics use verl's names under `rollout_corr/`: `rollout_is_*`, `rollout_rs_*`, and the off-policy diagnostics
`kl` (E[log pi_rollout - log pi_old]), `k3_kl`, `training_ppl`, `rollout_ppl`, their logs, `log_ppl_diff` (+ abs,
max, min), `ppl_ratio`, `chi2_token`, `chi2_seq`. Deviations: verl's metrics that are variants of the ones above
(seq_std, seq_max_deviation and the like) are left out; an empty mask gives zero metrics instead of an error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from polyrl.algorithms.masked import masked_mean, masked_sum
from polyrl.errors import ConfigError

SAFETY_BOUND = 20.0  # |log-ratio| clamp before exp(), as verl
_KEY = "algorithm.rollout_correction"


@dataclass
class RolloutCorrectionConfig:
    """verl's `algorithm.rollout_correction.*`: off by default (every field at its default)."""

    rollout_is: str | None = None
    """Importance weights between trainer and rollout log-probs: null (none), token or sequence."""
    rollout_is_threshold: float | str = 2.0
    """One number: truncate weights at it (TIS); "lower_upper": zero weights outside [lower, upper] (IcePop)."""
    rollout_is_batch_normalize: bool = False
    """Rescale the IS weights to mean 1 over the batch (token: over tokens; sequence: over sequences)."""
    rollout_rs: str | None = None
    """Rejection: comma-separated token_k1|2|3, seq_sum_k1|2|3, seq_mean_k1|2|3, seq_max_k2|3, binary_kl (or null)."""
    rollout_rs_threshold: float | str | None = None
    """Rejection threshold(s): one for all options or one per option, comma-separated; k1: "lower_upper" ratios."""
    bypass_mode: bool = False
    """Use the rollout log-probs as old log-probs (no old_log_prob pass); correction computed inside the update."""
    loss_type: str = "ppo_clip"
    """Bypass mode's loss: ppo_clip (the configured policy loss, ratio vs rollout) or reinforce (-w * A * log pi)."""

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode


# --------------------------------------------------------------------------- threshold parsing (user input)


def _number(text: str, key: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{_KEY}.{key}={text!r} is not a number; write e.g. 2.0 or '0.5_2.0'.") from None
    if not value > 0:
        raise ConfigError(f"{_KEY}.{key} must be positive, got {text!r}.")
    return value


def is_bounds(threshold: float | str) -> tuple[float | None, float]:
    """(lower or None, upper) of `rollout_is_threshold`: a number is TIS's upper bound, "lo_up" IcePop's band."""
    if isinstance(threshold, bool):
        raise ConfigError(f"{_KEY}.rollout_is_threshold={threshold!r} must be a number or 'lower_upper'.")
    if isinstance(threshold, (int, float)):
        return None, _number(str(threshold), "rollout_is_threshold")
    lower, sep, upper = str(threshold).strip().partition("_")
    if not sep:
        return None, _number(lower, "rollout_is_threshold")
    lo, up = _number(lower, "rollout_is_threshold"), _number(upper, "rollout_is_threshold")
    if lo > up:
        raise ConfigError(f"{_KEY}.rollout_is_threshold={threshold!r}: the lower bound exceeds the upper one.")
    return lo, up


def rs_options(rollout_rs: str) -> list[str]:
    """The distinct options of a comma-separated `rollout_rs`, each one checked."""
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    for o in options:
        if o not in RS_STATISTICS:
            raise ConfigError(f"{_KEY}.rollout_rs has unknown option {o!r}; use one of {sorted(RS_STATISTICS)}.")
    if not options:
        raise ConfigError(f"{_KEY}.rollout_rs={rollout_rs!r} names no option; use e.g. token_k3 or null.")
    return options


def rs_bounds(options: list[str], threshold: float | str | None) -> dict[str, tuple[float | None, float]]:
    """Per option (lower or None, upper) in the statistic's own units (k1: log-ratio bounds)."""
    if threshold is None:
        raise ConfigError(f"{_KEY}.rollout_rs is set but rollout_rs_threshold is null; give a threshold, e.g. 0.01.")
    specs = [s.strip() for s in str(threshold).split(",") if s.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ConfigError(f"{_KEY}.rollout_rs_threshold has {len(specs)} values for {len(options)} rollout_rs "
                          "options; give one shared value or one per option.")
    bounds = {}
    for option, spec in zip(options, specs):
        lower, sep, upper = spec.partition("_")
        if option.endswith("k1"):  # ratio bounds, compared with k1 = -log-ratio in log space
            up = _number(upper if sep else lower, "rollout_rs_threshold")
            lo = _number(lower, "rollout_rs_threshold") if sep else 1.0 / up
            if lo > up:
                raise ConfigError(f"{_KEY}.rollout_rs_threshold={spec!r} for {option} gives ratio bounds "
                                  f"[{lo:g}, {up:g}] that keep nothing; use an upper bound above 1, e.g. 2.0.")
            bounds[option] = (math.log(lo), math.log(up))
        elif sep:
            raise ConfigError(f"{_KEY}.rollout_rs_threshold={spec!r}: option {option} takes one upper bound, "
                              "not 'lower_upper'.")
        else:
            bounds[option] = (None, _number(spec, "rollout_rs_threshold"))
    return bounds


def check_rollout_correction(cfg: RolloutCorrectionConfig) -> None:
    """Refuse bad values with one sentence naming the key."""
    if cfg.rollout_is is not None and cfg.rollout_is not in ("token", "sequence"):
        raise ConfigError(f"{_KEY}.rollout_is={cfg.rollout_is!r}; use token, sequence or null.")
    is_bounds(cfg.rollout_is_threshold)
    if cfg.rollout_rs is not None:
        rs_bounds(rs_options(cfg.rollout_rs), cfg.rollout_rs_threshold)
    if cfg.loss_type not in ("ppo_clip", "reinforce"):
        raise ConfigError(f"{_KEY}.loss_type={cfg.loss_type!r}; use ppo_clip or reinforce.")
    if cfg.loss_type != "ppo_clip" and not cfg.bypass_mode:
        raise ConfigError(f"{_KEY}.loss_type={cfg.loss_type!r} applies in bypass mode only; set bypass_mode=True "
                          "or leave loss_type=ppo_clip.")


# --------------------------------------------------------------------------- the tensors


def _masked_max(x_BT, mask_BT):
    valid = mask_BT.bool()
    return torch.where(valid.any(), x_BT.masked_fill(~valid, -torch.inf).max(), x_BT.new_zeros(()))


def _masked_min(x_BT, mask_BT):
    return -_masked_max(-x_BT, mask_BT)


def is_weights(log_ratio_BT, mask_BT, level: str, threshold: float | str, batch_normalize: bool = False):
    """(weights [B, T] detached, raw weights before truncation, metrics) of truncated (TIS) or banded (IcePop) IS."""
    lower, upper = is_bounds(threshold)
    if level == "token":
        raw_BT = torch.exp(log_ratio_BT.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:  # sequence: the product of the token ratios, on every token of the row
        seq_log_B = masked_sum(log_ratio_BT, mask_BT, dim=-1)
        raw_BT = torch.exp(seq_log_B.clamp(-SAFETY_BOUND, SAFETY_BOUND)).unsqueeze(-1).expand_as(log_ratio_BT)
    raw_BT = (raw_BT * mask_BT).detach()
    if lower is None:
        w_BT = raw_BT.clamp(max=upper)
    else:
        w_BT = torch.where((raw_BT >= lower) & (raw_BT <= upper), raw_BT, torch.zeros_like(raw_BT))
    lower_for_metrics = 1.0 / upper if lower is None else lower
    m = {
        "rollout_is_mean": masked_mean(w_BT, mask_BT),
        "rollout_is_max": _masked_max(w_BT, mask_BT),
        "rollout_is_min": _masked_min(w_BT, mask_BT),
        "rollout_is_ratio_fraction_high": masked_mean((raw_BT > upper).float(), mask_BT),
        "rollout_is_ratio_fraction_low": masked_mean((raw_BT < lower_for_metrics).float(), mask_BT),
    }
    mean = m["rollout_is_mean"]
    m["rollout_is_std"] = (masked_mean(w_BT.square(), mask_BT) - mean.square()).clamp_min(0).sqrt()
    # effective sample size as a fraction of the tokens: 1 / E[(w / E[w])^2]
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean((w_BT / (mean + 1e-8)).square(), mask_BT).clamp_min(1e-8)
    seq_w_B = masked_mean(w_BT, mask_BT, dim=-1)
    has_B = (mask_BT.sum(-1) > 0).to(w_BT.dtype)
    m["rollout_is_seq_mean"] = masked_mean(seq_w_B, has_B)
    m["rollout_is_seq_max"] = _masked_max(seq_w_B, has_B)
    m["rollout_is_seq_min"] = _masked_min(seq_w_B, has_B)
    if lower is not None:
        m["rollout_is_oob_ratio"] = masked_mean(((raw_BT < lower) | (raw_BT > upper)).float(), mask_BT)
    if batch_normalize:
        norm = mean if level == "token" else m["rollout_is_seq_mean"]
        norm = torch.where(norm > 1e-8, norm, torch.ones_like(norm))
        w_BT = w_BT / norm
        m["rollout_is_batch_norm_factor"] = norm
    return w_BT, m


def _k1(lr_BT):
    return -lr_BT


def _k2(lr_BT):
    return 0.5 * lr_BT.square()


def _k3(lr_BT):
    return torch.exp(lr_BT) - 1.0 - lr_BT


def _binary_kl(logp_BT, logq_BT, eps=1e-6):
    p, q = (torch.exp(x.float()).clamp(eps, 1 - eps) for x in (logp_BT, logq_BT))
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def _token(stat_BT, mask_BT):
    return stat_BT


def _seq_sum(stat_BT, mask_BT):
    return masked_sum(stat_BT, mask_BT, dim=-1)


def _seq_mean(stat_BT, mask_BT):
    return masked_mean(stat_BT, mask_BT, dim=-1)


def _seq_max(stat_BT, mask_BT):
    return torch.where(mask_BT.bool(), stat_BT, torch.full_like(stat_BT, -torch.inf)).max(-1).values.clamp_min(
        torch.finfo(stat_BT.dtype).min)


# option -> (per-token statistic of (log_ratio, old, rollout), reduction to the token or the sequence level)
RS_STATISTICS: dict[str, tuple[Callable, Callable]] = {
    **{f"token_{k}": (f, _token) for k, f in (("k1", _k1), ("k2", _k2), ("k3", _k3))},
    **{f"seq_sum_{k}": (f, _seq_sum) for k, f in (("k1", _k1), ("k2", _k2), ("k3", _k3))},
    **{f"seq_mean_{k}": (f, _seq_mean) for k, f in (("k1", _k1), ("k2", _k2), ("k3", _k3))},
    **{f"seq_max_{k}": (f, _seq_max) for k, f in (("k2", _k2), ("k3", _k3))},
}
RS_STATISTICS["binary_kl"] = (None, _token)  # needs both log-probs: computed in rejection_mask


def rejection_mask(log_ratio_BT, old_BT, rollout_BT, mask_BT, rollout_rs: str, threshold):
    """(keep [B, T] in {0, 1}, metrics): a token stays if every option's statistic is inside its bounds."""
    options = rs_options(rollout_rs)
    bounds = rs_bounds(options, threshold)
    lr_BT = log_ratio_BT.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    valid_BT = mask_BT.bool()
    keep_BT = torch.ones_like(valid_BT)
    m = {}
    for option in options:
        estimator, reduce = RS_STATISTICS[option]
        if option == "binary_kl":
            stat = torch.maximum(_binary_kl(old_BT, rollout_BT), _binary_kl(rollout_BT, old_BT)).to(lr_BT.dtype)
        else:
            stat = reduce(estimator(lr_BT), mask_BT)
        lower, upper = bounds[option]
        ok = stat <= upper if lower is None else (stat >= lower) & (stat <= upper)
        ok_BT = ok if ok.dim() == 2 else ok.unsqueeze(-1).expand_as(valid_BT)
        keep_BT = keep_BT & ok_BT
        stat_BT = stat if stat.dim() == 2 else stat.unsqueeze(-1).expand_as(lr_BT)
        p = f"rollout_rs_{option}"
        m[f"{p}_mean"] = masked_mean(stat_BT, mask_BT)
        m[f"{p}_max"] = _masked_max(stat_BT, mask_BT)
        m[f"{p}_min"] = _masked_min(stat_BT, mask_BT)
        m[f"{p}_masked_fraction"] = masked_mean((~ok_BT).float(), mask_BT)
        m[f"{p}_seq_masked_fraction"] = _seq_fraction(~ok_BT & valid_BT, mask_BT)
    m["rollout_rs_masked_fraction"] = masked_mean((~keep_BT).float(), mask_BT)
    m["rollout_rs_seq_masked_fraction"] = _seq_fraction(~keep_BT & valid_BT, mask_BT)
    return keep_BT.to(mask_BT.dtype), m


def _seq_fraction(rejected_BT, mask_BT):
    """Fraction of the sequences with a valid token that lost at least one token."""
    has_B = (mask_BT.sum(-1) > 0).float()
    return masked_mean(rejected_BT.any(-1).float(), has_B)


def offpolicy_metrics(old_BT, rollout_BT, mask_BT) -> dict[str, torch.Tensor]:
    """verl's mismatch diagnostics: KL(pi_rollout || pi_old) two ways, perplexities, their ratio, chi^2."""
    has_B = (mask_BT.sum(-1) > 0).to(old_BT.dtype)
    mean_old_B = masked_mean(old_BT, mask_BT, dim=-1)
    mean_roll_B = masked_mean(rollout_BT, mask_BT, dim=-1)
    lr_BT = old_BT - rollout_BT
    log_ppl_diff_B = mean_roll_B - mean_old_B  # log(training ppl / rollout ppl)
    seq_lr_B = masked_sum(lr_BT, mask_BT, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": masked_mean(torch.exp(-mean_old_B), has_B),
        "training_log_ppl": masked_mean(-mean_old_B, has_B),
        "kl": masked_mean(-lr_BT, mask_BT),
        "k3_kl": masked_mean(_k3(lr_BT), mask_BT),
        "rollout_ppl": masked_mean(torch.exp(-mean_roll_B), has_B),
        "rollout_log_ppl": masked_mean(-mean_roll_B, has_B),
        "log_ppl_diff": masked_mean(log_ppl_diff_B, has_B),
        "log_ppl_abs_diff": masked_mean(log_ppl_diff_B.abs(), has_B),
        "log_ppl_diff_max": _masked_max(log_ppl_diff_B, has_B),
        "log_ppl_diff_min": _masked_min(log_ppl_diff_B, has_B),
        "ppl_ratio": masked_mean(torch.exp(log_ppl_diff_B), has_B),
        "chi2_token": masked_mean(torch.exp(2 * lr_BT.clamp(-SAFETY_BOUND, SAFETY_BOUND)), mask_BT) - 1.0,
        "chi2_seq": masked_mean(torch.exp(2 * seq_lr_B), has_B) - 1.0,
    }


@torch.no_grad()
def rollout_correction_tensors(old_logp_BT, rollout_logp_BT, mask_BT, cfg: RolloutCorrectionConfig):
    """`compute_rollout_correction` with metrics left as 0-d device tensors (no host sync): for the update loop."""
    if old_logp_BT.shape != rollout_logp_BT.shape or old_logp_BT.shape != mask_BT.shape:
        raise ValueError(f"log-prob shapes {tuple(old_logp_BT.shape)} / {tuple(rollout_logp_BT.shape)} and mask "
                         f"shape {tuple(mask_BT.shape)} must match")
    old_BT, roll_BT = old_logp_BT.detach().float(), rollout_logp_BT.detach().float()
    mask_f = mask_BT.float()
    log_ratio_BT = old_BT - roll_BT
    metrics: dict[str, torch.Tensor] = {}
    weights_BT = None
    if cfg.rollout_is is not None:
        weights_BT, is_m = is_weights(log_ratio_BT, mask_f, cfg.rollout_is, cfg.rollout_is_threshold,
                                      cfg.rollout_is_batch_normalize)
        metrics.update(is_m)
    keep_BT = mask_BT.clone()
    if cfg.rollout_rs is not None:
        keep_f, rs_m = rejection_mask(log_ratio_BT, old_BT, roll_BT, mask_f, cfg.rollout_rs, cfg.rollout_rs_threshold)
        keep_BT = (mask_f * keep_f).to(mask_BT.dtype)
        metrics.update(rs_m)
    metrics.update(offpolicy_metrics(old_BT, roll_BT, mask_f))
    return weights_BT, keep_BT, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def compute_rollout_correction(old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                               cfg: RolloutCorrectionConfig):
    """(IS weights [B, T] or None, response mask with rejected tokens removed, `rollout_corr/*` metrics as floats).

    `old_logp_BT`: the trainer's log-probs of the sampled tokens (pi_old; pi_theta in bypass mode); `rollout_logp_BT`:
    the engine's. Weights are 0 at padding and detached."""
    check_rollout_correction(cfg)
    weights_BT, keep_BT, metrics = rollout_correction_tensors(old_logp_BT, rollout_logp_BT, mask_BT, cfg)
    values = torch.stack([v.float().reshape(()) for v in metrics.values()]).tolist() if metrics else []
    return weights_BT, keep_BT, dict(zip(metrics, values))
