"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`): MMDiT over unpacked latents, CLIP x2 + T5 text.

- Condition per prompt: (embeds_TD, pooled_D) from `encode_prompt` (CLIP-L/G hidden states zero-padded to T5's
  width, then T5's max_sequence_length tokens; pooled = both CLIPs' projections). No mask: every prompt has the
  same length, as in the pipeline.
- FlowPolicy keeps latents as 2x2-packed tokens like the other families (the SDE math is elementwise, any fixed
  layout works); the adapter unpacks to [B, C, H, W] for the transformer, which patchifies by itself.
- timestep = sigma * num_train_timesteps (the scheduler's `timesteps`, which the pipeline passes as is).
- CFG: plain v_u + g (v_c - v_u) (flow_grpo SD3: guidance 4.5). Gradients flow through both branches here;
  flow_grpo SD3 detaches the unconditional one.
- Grid: the scheduler's own `set_timesteps(N)` (static `shift` from its config, or the dynamic mu if configured),
  exactly as the pipeline calls it.
- Decode: z / scaling_factor + shift_factor through the AutoencoderKL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrl.models.diffusion.adapters.base import (
    Cond,
    LatentShape,
    PipelineParts,
    cfg_plain,
    pack_2x2,
    register_family,
    stack_conds,
    unpack_2x2,
    vae_decode,
)


@dataclass
class SD3Adapter:
    """Calls an `SD3Transformer2DModel` the way `StableDiffusion3Pipeline.__call__` does."""

    latent: LatentShape
    dtype: torch.dtype
    num_train_timesteps: int = 1000

    def collate(self, conds: list[Cond]) -> Cond:
        return stack_conds(conds)

    def forward(self, module, x, sigma_B, cond):
        embeds, pooled = cond
        v = module(hidden_states=unpack_2x2(x.to(self.dtype), self.latent), encoder_hidden_states=embeds,
                   pooled_projections=pooled, timestep=sigma_B.float() * self.num_train_timesteps,
                   return_dict=False)[0]  # fmt: skip
        return pack_2x2(v)

    def guide(self, v_cond, v_uncond, scale):
        return cfg_plain(v_cond, v_uncond, scale)


@register_family("StableDiffusion3Pipeline")
def parts(pipe, *, height: int, width: int, max_sequence_length: int, guidance_scale: float) -> PipelineParts:
    factor = pipe.vae_scale_factor
    latent_h, latent_w = height // factor, width // factor
    latent = LatentShape(latent_h // 2, latent_w // 2, pipe.transformer.config.in_channels * 4)

    def encode(prompts: list[str]) -> list[Cond]:
        embeds, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device=pipe.device,
                                                  do_classifier_free_guidance=False,
                                                  max_sequence_length=max_sequence_length)  # fmt: skip
        return [(embeds[i], pooled[i]) for i in range(len(prompts))]

    def decode(latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(pipe, unpack_2x2(latents, latent))

    def sigmas(num_steps: int) -> torch.Tensor:
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

        c, kw = pipe.scheduler.config, {}
        if c.get("use_dynamic_shifting", None):
            patch = pipe.transformer.config.patch_size
            kw["mu"] = calculate_shift((latent_h // patch) * (latent_w // patch), c.get("base_image_seq_len", 256),
                                       c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                                       c.get("max_shift", 1.16))  # fmt: skip
        pipe.scheduler.set_timesteps(num_steps, device="cpu", **kw)
        return pipe.scheduler.sigmas.clone()

    adapter = SD3Adapter(latent, pipe.transformer.dtype, pipe.scheduler.config.num_train_timesteps)
    return PipelineParts(adapter, encode, decode, sigmas, latent)
