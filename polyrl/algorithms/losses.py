"""Loss aggregation, policy losses (registry), the clipped value loss, and logits helpers.

Follows verl's `core_algos.py`. Two things the trainer relies on:

1. **Normalisation does not depend on the micro-batch split.** `agg_loss` takes the *global* mini-batch
   normalisers (`num_tokens`: valid tokens in the mini-batch; `num_seqs`: sequences in it). With them, the sum
   of the micro-batch losses equals the loss of the whole mini-batch computed in one go. With data parallelism
   and gradient *averaging* (DDP/FSDP) the trainer multiplies each rank's loss by the DP size (verl does this
   inside `agg_loss` via `dp_size`; here it stays with the trainer that owns the mesh).
2. **Metrics stay on device.** Every metric is a detached 0-d tensor, so the trainer can average them across
   micro-batches without a host sync per step.

GRPO is `vanilla` with a symmetric clip; DAPO's clip-higher is `clip_ratio_high=0.28`; Dr.GRPO is
`seq-mean-token-sum-norm` aggregation.

Rollout-correction importance weights (`rollout_is_weights_BT`, polyrl/algorithms/rollout_correction.py) multiply
every loss's per-token loss matrix before aggregation, as verl passes `rollout_is_weights` to each registered loss;
`geo_mean` turns them into one geometric-mean weight per sequence (as verl).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from polyrl.algorithms.masked import masked_mean, masked_sum
from polyrl.errors import ConfigError

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# verl clamps log(pi/pi_old) before exp() so one wild token cannot overflow the ratio.
_LOG_RATIO_CLAMP = 20.0


def check_loss_agg_mode(mode: str) -> None:
    """Raise ConfigError naming actor.loss_agg_mode when `mode` is unknown."""
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(
            f"actor_rollout_ref.actor.loss_agg_mode={mode!r} is not supported; use one of {list(LOSS_AGG_MODES)}."
        )


def agg_loss(
    loss_mat_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    *,
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] loss matrix to a scalar; pass the mini-batch's `num_tokens`/`num_seqs` when micro-batching."""
    check_loss_agg_mode(mode)
    mask_BT = mask_BT.to(loss_mat_BT.dtype)
    if mode == "token-mean":
        if num_tokens is None:
            # clamp: a micro-batch with no valid token contributes 0 instead of NaN
            num_tokens = mask_BT.sum().clamp_min(1)
        return masked_sum(loss_mat_BT, mask_BT) / num_tokens
    if mode == "token-sum":
        return masked_sum(loss_mat_BT, mask_BT)

    tokens_per_seq_B = mask_BT.sum(dim=-1)
    has_tokens_B = (tokens_per_seq_B > 0).to(loss_mat_BT.dtype)  # fully masked rows do not count as sequences
    seq_losses_B = masked_sum(loss_mat_BT, mask_BT, dim=-1)
    if mode == "seq-mean-token-mean":
        seq_losses_B = seq_losses_B / (tokens_per_seq_B + 1e-8)
    if num_seqs is None:
        num_seqs = has_tokens_B.sum().clamp_min(1)
    loss = (seq_losses_B * has_tokens_B).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        # Dr.GRPO divides by a constant (the max response length) instead of each sequence's own length.
        loss = loss / (loss_scale_factor if loss_scale_factor is not None else mask_BT.shape[-1])
    return loss


# --------------------------------------------------------------------------- policy losses


@dataclass
class LossKnobs:
    """Knobs of the policy losses (verl's actor.clip_ratio* and actor.policy_loss.* keys)."""

    clip_ratio: float = 0.2
    """PPO clip epsilon, used for a side whose own bound is None."""
    clip_ratio_low: float | None = None
    """Lower clip: ratio >= 1 - clip_ratio_low (None: clip_ratio)."""
    clip_ratio_high: float | None = None
    """Upper clip: ratio <= 1 + clip_ratio_high (None: clip_ratio); DAPO clip-higher uses 0.28."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages: the loss is at most -A * clip_ratio_c; must be > 1."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of tokens whose gradient is cut among those with covariance in (lb, ub)."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance window."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the covariance window."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of tokens (largest covariance) that get the |log-ratio| penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of the |log-ratio| penalty."""
    loss_scale_factor: float | None = None
    """seq-mean-token-sum-norm divisor (None: the response-length dimension T, as verl)."""
    tau_pos: float = 1.0
    """sapo: gate temperature for tokens with a positive advantage."""
    tau_neg: float = 1.05
    """sapo: gate temperature for tokens with a non-positive advantage."""
    dro_beta: float = 0.1
    """dro: weight of the quadratic log-ratio penalty 0.5 * beta * (log pi - log pi_old)^2; must be > 0."""

    @classmethod
    def from_config(cls, actor, *, max_response_length: int) -> "LossKnobs":
        """From verl's `actor.*` clip keys and `actor.policy_loss.*`; loss_scale_factor defaults to the max response
        length."""
        pl = actor.policy_loss
        return cls(clip_ratio=actor.clip_ratio, clip_ratio_low=actor.clip_ratio_low,
                   clip_ratio_high=actor.clip_ratio_high, clip_ratio_c=actor.clip_ratio_c, tau_pos=actor.tau_pos,
                   tau_neg=actor.tau_neg, loss_scale_factor=actor.loss_scale_factor or max_response_length,
                   clip_cov_ratio=pl.clip_cov_ratio, clip_cov_lb=pl.clip_cov_lb, clip_cov_ub=pl.clip_cov_ub,
                   kl_cov_ratio=pl.kl_cov_ratio, ppo_kl_coef=pl.ppo_kl_coef, dro_beta=pl.dro_beta)

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


Aggregate = Callable[..., torch.Tensor]  # aggregate(loss_mat_BT, mode=<the configured mode>) -> scalar
PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str):
    """Register `fn(*, old_log_prob_BT, log_prob_BT, advantages_BT, response_mask_BT, cfg, aggregate,
    rollout_is_weights_BT)`; `aggregate(loss_mat_BT)` already applies the IS weights."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES and POLICY_LOSSES[name] is not fn:
            raise ValueError(f"policy loss {name!r} is already registered; pick another name")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def policy_loss(
    name: str,
    *,
    old_log_prob_BT: torch.Tensor,
    log_prob_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    loss_agg_mode: str,
    cfg: LossKnobs,
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    rollout_is_weights_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar policy loss and its metrics (detached 0-d tensors) from the loss registered as `name`;
    `rollout_is_weights_BT` (rollout correction) multiply the per-token losses."""
    if name not in POLICY_LOSSES:
        raise ConfigError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={name!r} is not a known policy loss; "
            f"use one of {sorted(POLICY_LOSSES)}."
        )
    check_loss_agg_mode(loss_agg_mode)
    mask_BT = response_mask_BT.to(log_prob_BT.dtype)

    def aggregate(loss_mat_BT: torch.Tensor, mode: str = loss_agg_mode, weights_BT=rollout_is_weights_BT):
        if weights_BT is not None:
            loss_mat_BT = loss_mat_BT * weights_BT
        return agg_loss(
            loss_mat_BT, mask_BT, mode, num_tokens=num_tokens, num_seqs=num_seqs,
            loss_scale_factor=cfg.loss_scale_factor,
        )  # fmt: skip

    return POLICY_LOSSES[name](
        old_log_prob_BT=old_log_prob_BT,
        log_prob_BT=log_prob_BT,
        advantages_BT=advantages_BT,
        response_mask_BT=mask_BT,
        cfg=cfg,
        aggregate=aggregate,
        rollout_is_weights_BT=rollout_is_weights_BT,
    )


def _detached(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in metrics.items()}


@register_policy_loss("vanilla")
def vanilla(*, old_log_prob_BT, log_prob_BT, advantages_BT, response_mask_BT, cfg, aggregate, **_):
    """PPO clip with separate low/high bounds, plus dual-clip (bound -A * clip_ratio_c) for negative advantages."""
    if not cfg.clip_ratio_c > 1.0:
        raise ConfigError(
            f"actor_rollout_ref.actor.clip_ratio_c={cfg.clip_ratio_c} must be greater than 1.0 (dual-clip PPO); "
            "the default is 3.0."
        )
    log_ratio_BT = torch.clamp(log_prob_BT - old_log_prob_BT, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * torch.clamp(ratio_BT, 1 - cfg.low, 1 + cfg.high)
    clip_loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_bound_BT = -advantages_BT * cfg.clip_ratio_c
    negative_BT = advantages_BT < 0
    losses_BT = torch.where(negative_BT, torch.minimum(dual_bound_BT, clip_loss_BT), clip_loss_BT)
    metrics = {
        "actor/pg_clipfrac": masked_mean((clipped_BT > unclipped_BT).float(), response_mask_BT),
        "actor/pg_clipfrac_lower": masked_mean(
            ((clip_loss_BT > dual_bound_BT) & negative_BT).float(), response_mask_BT
        ),
        "actor/ppo_kl": masked_mean(-log_ratio_BT, response_mask_BT),
    }
    return aggregate(losses_BT), _detached(metrics)


@register_policy_loss("gspo")
def gspo(*, old_log_prob_BT, log_prob_BT, advantages_BT, response_mask_BT, cfg, aggregate, **_):
    """GSPO (arXiv:2507.18071; verl `compute_policy_loss_gspo`): per-token ratio = sg(sequence geometric-mean ratio)
    * pi / sg(pi), PPO-clipped. Aggregated with the configured `loss_agg_mode`, as verl 0.9.1 (verl up to 0.8 forced
    seq-mean-token-mean, the mode the GSPO paper recommends: set it explicitly to get that)."""
    log_ratio_BT = log_prob_BT - old_log_prob_BT
    seq_len_B = response_mask_BT.sum(dim=-1).clamp(min=1)
    seq_log_ratio_B = masked_sum(log_ratio_BT, response_mask_BT, dim=-1) / seq_len_B
    # value: the sequence ratio; gradient: that of the token's own log-prob (GSPO-token)
    log_seq_ratio_BT = log_prob_BT - log_prob_BT.detach() + seq_log_ratio_B.detach().unsqueeze(-1)
    seq_ratio_BT = torch.exp(torch.clamp(log_seq_ratio_BT, max=10.0))
    unclipped_BT = -advantages_BT * seq_ratio_BT
    clipped_BT = -advantages_BT * torch.clamp(seq_ratio_BT, 1 - cfg.low, 1 + cfg.high)
    losses_BT = torch.maximum(unclipped_BT, clipped_BT)
    metrics = {
        "actor/pg_clipfrac": masked_mean((clipped_BT > unclipped_BT).float(), response_mask_BT),
        "actor/pg_clipfrac_lower": torch.zeros((), device=log_prob_BT.device),
        "actor/ppo_kl": masked_mean(-log_ratio_BT, response_mask_BT),
    }
    return aggregate(losses_BT), _detached(metrics)


@register_policy_loss("gpg")
def gpg(*, log_prob_BT, advantages_BT, aggregate, **_):
    """GPG: plain policy gradient -A * log pi, no ratio and no clip (no metrics, as verl)."""
    return aggregate(-log_prob_BT * advantages_BT), {}


@register_policy_loss("clip_cov")
def clip_cov(*, old_log_prob_BT, log_prob_BT, advantages_BT, response_mask_BT, cfg, aggregate, **_):
    """Clip-Cov: PPO clip, and cut the gradient of a random few tokens whose adv*logp covariance is in (lb, ub)."""
    if not cfg.clip_cov_ratio > 0:
        raise ConfigError(f"actor_rollout_ref.actor.policy_loss.clip_cov_ratio={cfg.clip_cov_ratio} must be > 0.")
    log_ratio_BT = log_prob_BT - old_log_prob_BT
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * torch.clamp(ratio_BT, 1 - cfg.low, 1 + cfg.high)
    valid_BT = response_mask_BT > 0
    with torch.no_grad():
        cov_BT = (advantages_BT - masked_mean(advantages_BT, response_mask_BT)) * (
            log_prob_BT - masked_mean(log_prob_BT, response_mask_BT)
        )
        already_clipped_BT = (clipped_BT > unclipped_BT) & valid_BT
        cov_BT = cov_BT.masked_fill(~valid_BT | already_clipped_BT, -torch.inf)
        candidates = torch.nonzero((cov_BT > cfg.clip_cov_lb) & (cov_BT < cfg.clip_cov_ub) & valid_BT)
        num_cut = max(int(cfg.clip_cov_ratio * response_mask_BT.sum().item()), 1)
        chosen = candidates[torch.randperm(len(candidates), device=candidates.device)[:num_cut]]
        keep_BT = torch.ones_like(advantages_BT)
        keep_BT[chosen[:, 0], chosen[:, 1]] = 0
    losses_BT = torch.maximum(unclipped_BT, clipped_BT) * keep_BT
    metrics = {
        "actor/pg_clipfrac": masked_mean((keep_BT == 0).float(), response_mask_BT),
        "actor/ppo_kl": masked_mean(-log_ratio_BT, response_mask_BT),
    }
    return aggregate(losses_BT), _detached(metrics)


@register_policy_loss("kl_cov")
def kl_cov(*, old_log_prob_BT, log_prob_BT, advantages_BT, response_mask_BT, cfg, aggregate, **_):
    """KL-Cov: unclipped -A * ratio, plus ppo_kl_coef * |log-ratio| on the top kl_cov_ratio tokens by covariance."""
    if not cfg.kl_cov_ratio > 0:
        raise ConfigError(f"actor_rollout_ref.actor.policy_loss.kl_cov_ratio={cfg.kl_cov_ratio} must be > 0.")
    log_ratio_BT = log_prob_BT - old_log_prob_BT
    abs_kl_BT = log_ratio_BT.abs()
    losses_BT = -advantages_BT * torch.exp(log_ratio_BT)
    valid_flat = torch.nonzero(response_mask_BT.reshape(-1) > 0).squeeze(-1)
    if valid_flat.numel() > 0:
        with torch.no_grad():
            adv_N = advantages_BT.reshape(-1)[valid_flat]
            logp_N = log_prob_BT.detach().reshape(-1)[valid_flat]
            cov_N = (adv_N - adv_N.mean()) * (logp_N - logp_N.mean())
            num_pen = max(1, int(valid_flat.numel() * cfg.kl_cov_ratio))
            penalised = valid_flat[torch.topk(cov_N, num_pen, largest=True).indices]
            penalty_mask_BT = torch.zeros(losses_BT.numel(), dtype=torch.bool, device=losses_BT.device)
            penalty_mask_BT[penalised] = True
            penalty_mask_BT = penalty_mask_BT.view_as(losses_BT)
        losses_BT = torch.where(penalty_mask_BT, losses_BT + cfg.ppo_kl_coef * abs_kl_BT, losses_BT)
    metrics = {"actor/ppo_kl": masked_mean(abs_kl_BT, response_mask_BT)}
    return aggregate(losses_BT), _detached(metrics)


def _clamped_ratio(log_prob_BT, old_log_prob_BT):
    log_ratio_BT = torch.clamp(log_prob_BT - old_log_prob_BT, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return log_ratio_BT, torch.exp(log_ratio_BT)


@register_policy_loss("sapo")
def sapo(*, old_log_prob_BT, log_prob_BT, advantages_BT, response_mask_BT, cfg, aggregate, **_):
    """SAPO (arXiv:2511.20347; verl `compute_policy_loss_sapo`): a soft gate instead of the hard clip,
    loss = -A * sigmoid(tau * (r - 1)) * 4 / tau with tau = tau_pos for A > 0, else tau_neg. Always
    seq-mean-token-mean, as verl's code does whatever loss_agg_mode says; no clip fractions (0, as verl)."""
    for key in ("tau_pos", "tau_neg"):
        if not getattr(cfg, key) > 0:
            raise ConfigError(f"actor_rollout_ref.actor.{key}={getattr(cfg, key)} must be > 0 (sapo's gate "
                              "temperature); verl's defaults are tau_pos=1.0, tau_neg=1.05.")
    log_ratio_BT, ratio_BT = _clamped_ratio(log_prob_BT, old_log_prob_BT)
    tau_BT = torch.where(advantages_BT > 0, cfg.tau_pos, cfg.tau_neg).to(ratio_BT.dtype)
    gates_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0)) * (4.0 / tau_BT)
    zero = torch.zeros((), device=log_prob_BT.device)
    metrics = {"actor/pg_clipfrac": zero, "actor/pg_clipfrac_lower": zero,
               "actor/ppo_kl": masked_mean(-log_ratio_BT, response_mask_BT)}
    return aggregate(-gates_BT * advantages_BT, mode="seq-mean-token-mean"), _detached(metrics)


@register_policy_loss("geo_mean")
def geo_mean(*, old_log_prob_BT, log_prob_BT, advantages_BT, response_mask_BT, cfg, aggregate,
             rollout_is_weights_BT=None, **_):
    """GMPO (arXiv:2507.20673; verl `compute_policy_loss_geo_mean`): sequence ratio = exp(mean of the token
    log-ratios, each clipped to [-low, high] on the side its advantage sign makes pessimistic), loss = -mean(A) * ratio
    per sequence, averaged over sequences (loss_agg_mode is ignored, as verl). IS weights become one per sequence,
    their geometric mean. Deviation: verl averages over the micro-batch's rows (torch.mean); we divide by the
    mini-batch's sequence count, which is the same number in one micro-batch and keeps micro-batching invariant."""
    log_ratio_BT = log_prob_BT - old_log_prob_BT
    sign_BT = torch.sign(advantages_BT)
    clamped_BT = torch.clamp(log_ratio_BT, -cfg.low, cfg.high)
    pessimistic_BT = sign_BT * torch.minimum(sign_BT * log_ratio_BT, sign_BT * clamped_BT)
    len_B = response_mask_BT.sum(-1)
    ratio_B = torch.exp(masked_sum(pessimistic_BT, response_mask_BT, dim=-1) / (len_B + 1e-8))
    adv_B = masked_sum(advantages_BT, response_mask_BT, dim=-1) / (len_B + 1e-8)
    seq_loss_B = -adv_B * ratio_B
    if rollout_is_weights_BT is not None:
        log_w_B = masked_sum(torch.log(rollout_is_weights_BT + 1e-10), response_mask_BT, dim=-1)
        seq_loss_B = seq_loss_B * torch.exp(log_w_B / (len_B + 1e-8))
    # each sequence's loss spread over its tokens, then summed per sequence and divided by the sequence count
    per_token_BT = (seq_loss_B / len_B.clamp_min(1)).unsqueeze(-1).expand_as(log_ratio_BT)
    clipped_BT = (log_ratio_BT != clamped_BT).float()
    metrics = {
        "actor/pg_clipfrac": masked_mean(clipped_BT * (advantages_BT > 0), response_mask_BT),
        "actor/pg_clipfrac_lower": masked_mean(clipped_BT * (advantages_BT < 0), response_mask_BT),
        "actor/ppo_kl": masked_mean(-log_ratio_BT, response_mask_BT),
    }
    return aggregate(per_token_BT, mode="seq-mean-token-sum", weights_BT=None), _detached(metrics)


@register_policy_loss("cispo")
def cispo(*, old_log_prob_BT, log_prob_BT, advantages_BT, response_mask_BT, cfg, aggregate, **_):
    """CISPO (arXiv:2506.13585; verl `compute_policy_loss_cispo`): clip the IS weight, not the update:
    loss = -sg(clip(r, 1 - low, 1 + high)) * A * log pi, so every token keeps a gradient."""
    log_ratio_BT, ratio_BT = _clamped_ratio(log_prob_BT, old_log_prob_BT)
    clipped_BT = torch.clamp(ratio_BT, 1 - cfg.low, 1 + cfg.high)
    metrics = {
        "actor/pg_clipfrac": masked_mean((ratio_BT != clipped_BT).float(), response_mask_BT),
        "actor/pg_clipfrac_lower": torch.zeros((), device=log_prob_BT.device),
        "actor/ppo_kl": masked_mean(-log_ratio_BT, response_mask_BT),
    }
    return aggregate(-clipped_BT.detach() * advantages_BT * log_prob_BT), _detached(metrics)


@register_policy_loss("dro")
def dro(*, old_log_prob_BT, log_prob_BT, advantages_BT, response_mask_BT, cfg, aggregate, **_):
    """DRO (Richemond et al. 2024, arXiv:2405.19107; verl `dro`): loss = -(A * log pi - beta/2 * (log pi -
    log pi_old)^2), a quadratic proximal penalty instead of a clip; the log-ratio is not clamped (as verl)."""
    if not cfg.dro_beta > 0:
        raise ConfigError(f"actor_rollout_ref.actor.policy_loss.dro_beta={cfg.dro_beta} must be > 0.")
    log_ratio_BT = log_prob_BT - old_log_prob_BT
    losses_BT = -(advantages_BT * log_prob_BT - 0.5 * cfg.dro_beta * log_ratio_BT.square())
    metrics = {"actor/ppo_kl": masked_mean(-log_ratio_BT, response_mask_BT)}
    return aggregate(losses_BT), _detached(metrics)


def _dppo(valid_BT, log_ratio_BT, ratio_BT, log_prob_BT, advantages_BT, response_mask_BT, cfg, aggregate):
    """DPPO's shared tail: -A * sg(min(r, clip_ratio_c)) * log pi on the tokens inside the divergence region."""
    valid_BT = valid_BT.detach().float()
    truncated_BT = torch.clamp(ratio_BT, max=cfg.clip_ratio_c).detach()
    metrics = {
        "actor/pg_clipfrac": masked_mean(1.0 - valid_BT, response_mask_BT),
        "actor/pg_clipfrac_lower": masked_mean((ratio_BT > cfg.clip_ratio_c).float() * valid_BT, response_mask_BT),
        "actor/ppo_kl": masked_mean(-log_ratio_BT, response_mask_BT),
    }
    return aggregate(-advantages_BT * truncated_BT * log_prob_BT * valid_BT), _detached(metrics)


@register_policy_loss("dppo_tv")
def dppo_tv(*, old_log_prob_BT, log_prob_BT, advantages_BT, response_mask_BT, cfg, aggregate, **_):
    """DPPO-Binary-TV (arXiv:2602.04879; verl `compute_policy_loss_dppo_tv`): a token takes part unless its
    probability moved past the TV bound in the advantage's direction (p - p_old > clip_ratio_high for A > 0,
    < -clip_ratio_low otherwise); clip_ratio* are TV thresholds here, clip_ratio_c truncates the detached ratio."""
    log_ratio_BT, ratio_BT = _clamped_ratio(log_prob_BT, old_log_prob_BT)
    diff_BT = torch.exp(log_prob_BT) - torch.exp(old_log_prob_BT)
    valid_BT = torch.where(advantages_BT > 0, diff_BT <= cfg.high, diff_BT >= -cfg.low)
    return _dppo(valid_BT, log_ratio_BT, ratio_BT, log_prob_BT, advantages_BT, response_mask_BT, cfg, aggregate)


@register_policy_loss("dppo_kl")
def dppo_kl(*, old_log_prob_BT, log_prob_BT, advantages_BT, response_mask_BT, cfg, aggregate, **_):
    """DPPO-Binary-KL (arXiv:2602.04879; verl `compute_policy_loss_dppo_kl`): as dppo_tv with the Bernoulli KL
    KL([p_old, 1 - p_old] || [p, 1 - p]) against clip_ratio_high / clip_ratio_low, only when p moved in the
    advantage's direction."""
    log_ratio_BT, ratio_BT = _clamped_ratio(log_prob_BT, old_log_prob_BT)
    p_BT, p_old_BT = torch.exp(log_prob_BT), torch.exp(old_log_prob_BT)
    binary_kl_BT = p_old_BT * (old_log_prob_BT - log_prob_BT) + (1 - p_old_BT) * torch.log(
        (1.0 - p_old_BT + 1e-8) / (1.0 - p_BT + 1e-8))
    valid_BT = torch.where(advantages_BT > 0, (binary_kl_BT <= cfg.high) | (p_BT <= p_old_BT),
                           (binary_kl_BT <= cfg.low) | (p_BT >= p_old_BT))
    return _dppo(valid_BT, log_ratio_BT, ratio_BT, log_prob_BT, advantages_BT, response_mask_BT, cfg, aggregate)


# --------------------------------------------------------------------------- value loss, logits helpers


def value_loss(
    vpreds_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    values_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str,
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * agg(max((v - R)^2, (clip(v, V +- c) - R)^2)) and the clipped fraction."""
    vpred_clipped_BT = torch.clamp(vpreds_BT, values_BT - cliprange_value, values_BT + cliprange_value)
    loss1_BT = (vpreds_BT - returns_BT) ** 2
    loss2_BT = (vpred_clipped_BT - returns_BT) ** 2
    mask_BT = response_mask_BT.to(vpreds_BT.dtype)
    vf_loss = 0.5 * agg_loss(
        torch.maximum(loss1_BT, loss2_BT), mask_BT, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs
    )
    vf_clipfrac = masked_mean((loss2_BT > loss1_BT).float(), mask_BT).detach()
    return vf_loss, vf_clipfrac


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position: logsumexp(l) - sum(p * l)."""
    probs_BTV = F.softmax(logits_BTV, dim=-1)
    return torch.logsumexp(logits_BTV, dim=-1) - (probs_BTV * logits_BTV).sum(dim=-1)


def logprobs_from_logits(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] per position."""
    if logits_BTV.dtype in (torch.float32, torch.float64):
        picked_BT = logits_BTV.gather(-1, labels_BT.unsqueeze(-1)).squeeze(-1)
        return picked_BT - torch.logsumexp(logits_BTV, dim=-1)
    # logsumexp in bf16/fp16 is too imprecise (verl avoids it too); compute in float32 and return float32
    return F.log_softmax(logits_BTV.float(), dim=-1).gather(-1, labels_BT.unsqueeze(-1)).squeeze(-1)
