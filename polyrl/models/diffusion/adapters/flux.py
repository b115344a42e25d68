"""FLUX.1 (`FluxPipeline`): packed 2x2 latents with RoPE position ids, CLIP pooled + T5 text, optional guidance embed.

- Condition per prompt: (embeds_TD, pooled_D) from `encode_prompt` (T5 padded to max_sequence_length, CLIP pooled);
  `txt_ids` are zeros and `img_ids` the (0, row, col) grid, both 2-D as the pipeline passes them.
- timestep = sigma: the pipeline passes t / 1000 and the transformer multiplies timestep (and guidance) by 1000.
- Guidance-distilled checkpoints (`guidance_embeds`, FLUX.1-dev) get `guidance = rollout.pipeline.guidance_scale`
  on every call: that is their non-CFG path. True CFG (`true_cfg_scale > 1`) is plain v_u + g (v_c - v_u), as
  FluxPipeline's `true_cfg_scale`, but batched into one forward.
- Grid: sigmas linspace(1, 1/N, N) with the dynamic shift mu of the image sequence length, as the pipeline.
- Decode: unpack, z / scaling_factor + shift_factor through the AutoencoderKL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrl.models.diffusion.adapters.base import (
    Cond,
    LatentShape,
    PipelineParts,
    cfg_plain,
    register_family,
    stack_conds,
    unpack_2x2,
    vae_decode,
)


def image_ids(latent: LatentShape) -> torch.Tensor:
    """[grid_h * grid_w, 3] RoPE ids (0, row, col) of the packed tokens (FluxPipeline._prepare_latent_image_ids)."""
    rows = torch.arange(latent.grid_h).repeat_interleave(latent.grid_w)
    cols = torch.arange(latent.grid_w).repeat(latent.grid_h)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).float()


@dataclass
class FluxAdapter:
    """Calls a `FluxTransformer2DModel` the way `FluxPipeline.__call__` does."""

    latent: LatentShape
    dtype: torch.dtype
    guidance_scale: float | None = None
    """Set for guidance-distilled models (`guidance_embeds`); None for the others (schnell)."""

    def __post_init__(self):
        self._img_ids = image_ids(self.latent).to(self.dtype)

    def collate(self, conds: list[Cond]) -> Cond:
        return stack_conds(conds)

    def forward(self, module, x, sigma_B, cond):
        embeds, pooled = cond
        guidance = None
        if self.guidance_scale is not None:
            guidance = torch.full((x.shape[0],), self.guidance_scale, device=x.device, dtype=torch.float32)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=x.device, dtype=self.dtype)
        if self._img_ids.device != x.device:  # moved once: a per-call host-to-device copy would sync the host
            self._img_ids = self._img_ids.to(x.device)
        img_ids = self._img_ids
        return module(hidden_states=x.to(self.dtype), encoder_hidden_states=embeds, pooled_projections=pooled,
                      timestep=sigma_B.to(self.dtype), img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
                      return_dict=False)[0]  # fmt: skip

    def guide(self, v_cond, v_uncond, scale):
        return cfg_plain(v_cond, v_uncond, scale)


@register_family("FluxPipeline")
def parts(pipe, *, height: int, width: int, max_sequence_length: int, guidance_scale: float) -> PipelineParts:
    factor = pipe.vae_scale_factor
    latent = LatentShape(height // factor // 2, width // factor // 2, pipe.transformer.config.in_channels)

    def encode(prompts: list[str]) -> list[Cond]:
        embeds, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, device=pipe.device,
                                               max_sequence_length=max_sequence_length)  # fmt: skip
        return [(embeds[i], pooled[i]) for i in range(len(prompts))]

    def decode(latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(pipe, unpack_2x2(latents, latent))

    def sigmas(num_steps: int) -> torch.Tensor:
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        c = pipe.scheduler.config
        grid = None if c.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / num_steps, num_steps)
        mu = calculate_shift(latent.grid_h * latent.grid_w, c.get("base_image_seq_len", 256),
                             c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                             c.get("max_shift", 1.15))  # fmt: skip
        retrieve_timesteps(pipe.scheduler, num_steps, "cpu", sigmas=grid, mu=mu)
        return pipe.scheduler.sigmas.clone()

    guidance = guidance_scale if pipe.transformer.config.guidance_embeds else None
    adapter = FluxAdapter(latent, pipe.transformer.dtype, guidance)
    return PipelineParts(adapter, encode, decode, sigmas, latent)
