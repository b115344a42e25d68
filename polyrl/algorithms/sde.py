"""One denoising step of a rectified-flow sampler, with the per-step log-probability FlowGRPO trains on.

Notation (research/flowgrpo.md §1): x_sigma = (1 - sigma) x0 + sigma eps, the model predicts v ~ eps - x0, the grid
runs sigma_0 = 1 > ... > sigma_N = 0 and a step goes from `sigma` to `sigma_next` (delta = sigma - sigma_next > 0).

Step types live in a name->function registry (`STEP_TYPES`, key `rollout.algo.sde_type`). Each returns the
Gaussian mean and std of x_next given (x, v); the sampler draws x_next = mean + std * z and the trainer recomputes
the log-prob of the *stored* x_next under the current policy's mean:

- `sde` (Flow-GRPO): s = a sqrt(sigma / (1 - sigma)) (at sigma = 1 the denominator uses `sigma_max`, the second grid
  point, as flow_grpo does), mean = x - delta [v + s^2/(2 sigma) (x + (1 - sigma) v)], std = s sqrt(delta).
- `cps` (coefficients-preserving): std = sigma_next sin(a pi / 2), mean = (1 - sigma_next) x0_hat
  + sqrt(sigma_next^2 - std^2) eps_hat. Its "log-prob" is the surrogate -(x_next - mean)^2 (no variance), as upstream.
- `dance_sde` (DanceGRPO): mean = x - delta v - (a^2 delta / (2 sigma^2)) (x - (1 - sigma) x0_hat), std = a sqrt(delta).

Everything is computed in fp32 whatever the model's dtype, and the log-prob is the *mean* over latent elements (not
the sum): the PPO ratio is the D-th root of the density ratio, which is why clip ranges are 1e-4..1e-5.
A `noise_level` of 0 gives the deterministic Euler (ODE) step for every type; its log-prob is meaningless (0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from polyrl.errors import ConfigError

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class StepOut:
    """The Gaussian of one step: mean (x's shape), std (broadcastable to it), and the sample / log-prob if asked."""

    mean: torch.Tensor
    std: torch.Tensor
    x_next: torch.Tensor | None = None
    log_prob_B: torch.Tensor | None = None


StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
STEP_TYPES: dict[str, StepFn] = {}
# Step types whose log-prob is a true Gaussian log-density (cps is a surrogate).
GAUSSIAN_TYPES = {"sde", "dance_sde"}


def register_step(name: str):
    """Register `fn(x, v, sigma, sigma_next, noise_level, sigma_max) -> (mean, std)` under `name`."""

    def decorator(fn: StepFn) -> StepFn:
        if name in STEP_TYPES and STEP_TYPES[name] is not fn:
            raise ValueError(f"SDE step type {name!r} is already registered; pick another name")
        STEP_TYPES[name] = fn
        return fn

    return decorator


def _bcast(t: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """A scalar or per-sample [B] tensor viewed as [B, 1, ..., 1] in fp32."""
    t = torch.as_tensor(t, dtype=torch.float32, device=like.device)
    return t.reshape(-1, *([1] * (like.ndim - 1))) if t.ndim else t


@register_step("sde")
def sde(x, v, sigma, sigma_next, noise_level, sigma_max):
    delta = sigma - sigma_next
    denom = 1 - torch.where(sigma >= 1, torch.as_tensor(sigma_max, dtype=sigma.dtype, device=sigma.device), sigma)
    s = noise_level * torch.sqrt(sigma / denom)
    mean = x - delta * (v + s**2 / (2 * sigma) * (x + (1 - sigma) * v))
    return mean, s * torch.sqrt(delta)


@register_step("cps")
def cps(x, v, sigma, sigma_next, noise_level, sigma_max):
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    x0_hat, eps_hat = x - sigma * v, x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0_hat + torch.sqrt((sigma_next**2 - std**2).clamp_min(0)) * eps_hat
    return mean, std


@register_step("dance_sde")
def dance_sde(x, v, sigma, sigma_next, noise_level, sigma_max):
    delta = sigma - sigma_next
    x0_hat = x - sigma * v
    mean = x - delta * v - (noise_level**2 * delta / (2 * sigma**2)) * (x - (1 - sigma) * x0_hat)
    return mean, noise_level * torch.sqrt(delta)


def check_step_type(name: str) -> None:
    if name not in STEP_TYPES:
        raise ConfigError(
            f"actor_rollout_ref.rollout.algo.sde_type={name!r} is not a known step type; use one of {sorted(STEP_TYPES)}."
        )


def gaussian_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, sde_type: str) -> torch.Tensor:
    """Per-sample mean over elements of log N(x_next; mean, std^2) (cps: the surrogate -(x_next - mean)^2)."""
    diff = x_next.detach().float() - mean
    if sde_type in GAUSSIAN_TYPES:
        std = std.expand_as(mean) if std.ndim else std
        lp = -(diff**2) / (2 * std**2) - torch.log(std) - _HALF_LOG_2PI
    else:
        lp = -(diff**2)
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def step(
    sde_type: str,
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    *,
    noise_level: float,
    sigma_max: float,
    x_next: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> StepOut:
    """One step from `sigma` to `sigma_next` (scalars or per-sample [B]); samples x_next unless it is given.

    With `noise_level == 0` this is the Euler ODE step (x_next = mean, log-prob 0). `sigma_max` is the grid's
    second point, substituted at sigma = 1 by the `sde` type to avoid a division by zero.
    """
    check_step_type(sde_type)
    x32, v32 = x.float(), v.float()
    sigma_t, sigma_next_t = _bcast(sigma, x32), _bcast(sigma_next, x32)
    if noise_level == 0:
        mean = x32 - (sigma_t - sigma_next_t) * v32
        zeros = torch.zeros(x.shape[0], device=x.device)
        return StepOut(mean, torch.zeros(()), mean if x_next is None else x_next, zeros)
    mean, std = STEP_TYPES[sde_type](x32, v32, sigma_t, sigma_next_t, noise_level, sigma_max)
    std = torch.as_tensor(std, dtype=torch.float32, device=x.device)
    if x_next is None:
        # draw where the generator lives (the trainer's is a CPU generator: checkpointable, device-independent)
        gen_device = generator.device if generator is not None else x.device
        noise = torch.randn(x.shape, generator=generator, device=gen_device, dtype=torch.float32).to(x.device)
        x_next = mean + std * noise
    return StepOut(mean, std, x_next, gaussian_log_prob(x_next, mean, std, sde_type))


# --------------------------------------------------------------------------- KL to the reference policy

KLFn = Callable[..., torch.Tensor]
KL_TYPES: dict[str, KLFn] = {}


def register_kl(name: str):
    """Register `fn(mean, ref_mean, std, v, ref_v) -> kl_B` (per-sample, mean over elements)."""

    def decorator(fn: KLFn) -> KLFn:
        KL_TYPES[name] = fn
        return fn

    return decorator


@register_kl("mean")
def kl_on_means(mean, ref_mean, std, v, ref_v):
    """Exact KL between the two equal-variance Gaussian steps, per element: (mu - mu_ref)^2 / (2 std^2).

    flow_grpo/verl-omni divide by 2 s^2 without the step's delta, i.e. they report delta x this value; the two
    differ only by a per-step rescale of the coefficient beta.
    """
    sq = (mean - ref_mean) ** 2 / (2 * std**2)
    return sq.mean(dim=tuple(range(1, sq.ndim)))


@register_kl("velocity")
def kl_on_velocity(mean, ref_mean, std, v, ref_v):
    """Squared velocity difference, the author's recommendation when training without CFG (flow_grpo#198)."""
    sq = (v.float() - ref_v.float()) ** 2
    return sq.mean(dim=tuple(range(1, sq.ndim)))


def kl_to_ref(kind: str, **tensors) -> torch.Tensor:
    if kind not in KL_TYPES:
        raise ConfigError(
            f"actor_rollout_ref.actor.kl_loss_type={kind!r} is not a diffusion KL; use one of {sorted(KL_TYPES)}."
        )
    return KL_TYPES[kind](**tensors)


# --------------------------------------------------------------------------- which steps are stochastic / trained


def sde_steps(
    num_steps: int,
    *,
    sde_window_size: int | None,
    sde_window_range: tuple[int, int] | list[int] | None,
    timestep_fraction: float,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Indices of the steps that are sampled with noise and trained; the others are ODE steps.

    `sde_window_size` > 0: a window [s, s + w) with s uniform so the window fits inside `sde_window_range`
    (Flow-GRPO-Fast / MixGRPO / verl-omni). One window per batch (flow_grpo; verl-omni draws one per sample).
    Otherwise the first floor(num_steps * timestep_fraction) steps (flow_grpo SD3; never the last step, whose
    Gaussian is extremely peaked).
    """
    if sde_window_size:
        lo, hi = sde_window_range if sde_window_range is not None else (0, num_steps - 1)
        hi = min(hi, num_steps - 1)  # the last step is never stochastic
        if sde_window_size > hi - lo or lo < 0:
            raise ConfigError(
                f"actor_rollout_ref.rollout.algo.sde_window_size={sde_window_size} does not fit in "
                f"sde_window_range=[{lo}, {hi}) with num_inference_steps={num_steps}; shrink the window or widen the range."
            )
        start = lo + int(torch.randint(0, hi - lo - sde_window_size + 1, (1,), generator=generator))
        return list(range(start, start + sde_window_size))
    count = min(int(num_steps * timestep_fraction), num_steps - 1)
    if count < 1:
        raise ConfigError(
            f"actor_rollout_ref.rollout.algo.timestep_fraction={timestep_fraction} trains no step of {num_steps}; "
            "raise it (flow_grpo uses 0.99) or set sde_window_size."
        )
    return list(range(count))
