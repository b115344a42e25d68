"""The rollout loop: integrate from noise to an image, stochastic on the trained steps and ODE elsewhere.

The model is hidden behind `velocity_fn(x, sigma_B) -> v` (already CFG-combined), so the same loop drives the tiny
quickstart transformer and a diffusers pipeline. Only the trained steps are stored (x, x_next, log-prob): they are
what the trainer replays, one forward/backward per step.

Noise can come from one generator for the whole batch, or from one generator per sample (`sample_generators`:
seeded by (seed, step, global sample index)). The trainer uses the latter, so a sample's trajectory is the same
whichever chunk, rank or process count generates it: 1 and N processes then train on the same rollouts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from polyrl.algorithms import sde as sde_lib

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


def sample_generators(seed: int, step: int, sample_ids: list[int]) -> list[torch.Generator]:
    """One CPU generator per sample, seeded by (seed, step, sample id) through numpy's SeedSequence (well mixed)."""
    import numpy as np

    out = []
    for i in sample_ids:
        state = np.random.SeedSequence([seed, step, i]).generate_state(1, dtype=np.uint64)[0]
        out.append(torch.Generator().manual_seed(int(state) & (2**63 - 1)))
    return out


def per_sample_noise(shape: tuple[int, ...], generators: list[torch.Generator]) -> torch.Tensor:
    """[B, *shape] fp32 standard normal on the CPU, row b drawn from generators[b]."""
    return torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) for g in generators])


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
    generators: list[torch.Generator] | None = None,
    step_precision: Callable[[bool], AbstractContextManager] | None = None,
) -> Trajectory:
    """Integrate `noise` along `sigmas`; steps in `train_steps` are SDE steps whose (x, x_next, log-prob) are kept.

    SDE noise comes from `generators` (one per sample) when given, else from `generator` for the whole batch.
    `step_precision(trained)`: the context a step's velocity forward runs in (FP8 sampling runs the ODE steps in FP8
    and, by default, the trained steps in the model dtype: polyrl/rollout/fp8_dit.py)."""
    sde_lib.check_step_type(sde_type)
    sigma_max = float(sigmas[1])
    x = noise
    kept_x, kept_next, kept_lp = [], [], []
    train_set = set(train_steps)
    for i in range(len(sigmas) - 1):
        sigma = sigmas[i].expand(x.shape[0]).to(x.device)
        with step_precision(i in train_set) if step_precision else contextlib.nullcontext():
            v = velocity_fn(x, sigma)
        level = noise_level if i in train_set else 0.0
        if generators is not None and level > 0:
            out = _step_per_sample_noise(sde_type, x, v, sigmas[i], sigmas[i + 1], level, sigma_max, generators)
        else:
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


def _step_per_sample_noise(sde_type, x, v, sigma, sigma_next, level, sigma_max, generators) -> sde_lib.StepOut:
    """`sde_lib.step` with each sample's noise from its own generator: the step's Gaussian (asked for with a
    placeholder x_next), then x_next = mean + std * noise and its log-prob exactly as `step` computes them."""
    g = sde_lib.step(sde_type, x, v, sigma, sigma_next, noise_level=level, sigma_max=sigma_max, x_next=x)
    x_next = g.mean + g.std * per_sample_noise(tuple(x.shape[1:]), generators).to(x.device)
    return sde_lib.StepOut(g.mean, g.std, x_next, sde_lib.gaussian_log_prob(x_next, g.mean, g.std, sde_type))
