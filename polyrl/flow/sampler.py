"""The rollout loop: integrate from noise to an image, stochastic on the trained steps and ODE elsewhere.

The model is hidden behind `velocity_fn(x, sigma_B) -> v` (already CFG-combined), so the same loop drives the tiny
quickstart transformer and a diffusers pipeline. Only the trained steps are stored (x, x_next, log-prob): they are
what the trainer replays, one forward/backward per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from polyrl.flow import sde as sde_lib

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Trajectory:
    """What the trainer needs from one rollout batch of B samples with K trained steps."""

    latents_KB: torch.Tensor
    """x at each trained step, [K, B, ...] (the model's dtype)."""
    next_latents_KB: torch.Tensor
    """The sampled x_next of each trained step, [K, B, ...] (fp32)."""
    log_probs_KB: torch.Tensor
    """Rollout log-prob of each trained step, [K, B] (fp32, mean over elements)."""
    step_indices: list[int]
    """Which grid steps were trained (their sigma is sigmas[i], the next one sigmas[i + 1])."""
    final_B: torch.Tensor
    """The clean latents at sigma = 0, [B, ...]."""


def timestep_grid(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """sigma_0 = 1 > ... > sigma_N = 0 with the SD3 time shift s*t / (1 + (s - 1) t); N + 1 points (fp32)."""
    t = torch.linspace(1.0, 0.0, num_steps + 1)
    return shift * t / (1 + (shift - 1) * t)


@torch.no_grad()
def sample(
    velocity_fn: VelocityFn,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    sde_type: str,
    noise_level: float,
    train_steps: list[int],
    generator: torch.Generator | None = None,
) -> Trajectory:
    """Integrate `noise` along `sigmas`; steps in `train_steps` are SDE steps whose (x, x_next, log-prob) are kept."""
    sde_lib.check_step_type(sde_type)
    sigma_max = float(sigmas[1])
    x = noise
    kept_x, kept_next, kept_lp = [], [], []
    train_set = set(train_steps)
    for i in range(len(sigmas) - 1):
        sigma = sigmas[i].expand(x.shape[0]).to(x.device)
        v = velocity_fn(x, sigma)
        level = noise_level if i in train_set else 0.0
        out = sde_lib.step(sde_type, x, v, sigmas[i], sigmas[i + 1], noise_level=level, sigma_max=sigma_max,
                           generator=generator)  # fmt: skip
        if i in train_set:
            kept_x.append(x)
            kept_next.append(out.x_next)
            kept_lp.append(out.log_prob_B)
        x = out.x_next.to(noise.dtype)
    return Trajectory(
        latents_KB=torch.stack(kept_x) if kept_x else noise.new_zeros((0, *noise.shape)),
        next_latents_KB=torch.stack(kept_next) if kept_next else noise.new_zeros((0, *noise.shape)).float(),
        log_probs_KB=torch.stack(kept_lp) if kept_lp else torch.zeros(0, noise.shape[0]),
        step_indices=sorted(train_set),
        final_B=x,
    )
