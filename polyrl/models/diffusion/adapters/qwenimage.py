"""Qwen-Image (`QwenImagePipeline`): packed 2x2 latents, variable-length text with a mask, RoPE over `img_shapes`.

- Condition per prompt: (embeds_TD, mask_T), Qwen2.5-VL's last hidden state without the template tokens.
- timestep = sigma (the transformer takes sigma directly; the pipeline passes t / 1000).
- CFG is "true CFG" with Qwen-Image's per-token norm rescale v *= |v_c| / |v| (both upstream repos).
- Grid: sigmas linspace(1, 1/N, N) through the scheduler with the dynamic shift mu of the image sequence length.
- Decode: the 5-D Wan-style VAE with per-channel latents_mean / latents_std; its causal 3x3x3 convolutions run as
  2-D ones on an image's one frame (`one_frame_convs`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from polyrl.models.diffusion.adapters.base import Cond, LatentShape, PipelineParts, register_family


TEXT_PAD_MULTIPLE = 32


def pad_prompts(items: list[Cond], multiple: int = TEXT_PAD_MULTIPLE) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-pad variable-length prompt embeddings to one [B, T, D] batch and its [B, T] mask, T a multiple of
    `multiple`.

    Each cached entry holds only its prompt's own tokens (`encode` below cuts the padding off). Rounding T up to a
    multiple keeps the transformer's shapes to a few buckets: the compiled rollout builds one graph per shape, and
    real prompts (20-60 tokens) would otherwise bring a new length nearly every step, each a recompile and, past
    dynamo's recompile limit, eager blocks (measured on an H200: 0.51 img/s with a new length per step). Padded tokens
    are masked out of attention, so the image tokens' velocity is the unpadded one (test). When every entry is already
    T long nothing is padded and the mask is None: unmasked attention (SDPA's flash kernel), the same result."""
    t_max = max(e.shape[0] for e, _ in items)
    t_pad = -(-t_max // multiple) * multiple
    if all(e.shape[0] == t_pad for e, _ in items):
        return torch.stack([e for e, _ in items]), None
    embeds = items[0][0].new_zeros(len(items), t_pad, items[0][0].shape[-1])
    mask = torch.zeros(len(items), t_pad, dtype=torch.long, device=embeds.device)
    for i, (e, m) in enumerate(items):
        embeds[i, : e.shape[0]] = e
        mask[i, : m.shape[0]] = m
    return embeds, mask


def cfg_combine(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """True CFG with Qwen-Image's rescale: the guided velocity keeps the conditional branch's per-token norm."""
    guided = v_uncond + scale * (v_cond - v_uncond)
    return guided * (v_cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True).clamp_min(1e-12))


@dataclass
class QwenImageAdapter:
    """Calls a `QwenImageTransformer2DModel` (or anything with its keyword interface, like the quickstart's)."""

    latent: LatentShape
    dtype: torch.dtype

    def collate(self, conds: list[Cond]) -> Cond:
        return pad_prompts(conds)

    def forward(self, module, x, sigma_B, cond):
        embeds, mask = cond
        img_shapes = [[(1, self.latent.grid_h, self.latent.grid_w)]] * x.shape[0]
        return module(hidden_states=x.to(self.dtype), encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
                      timestep=sigma_B.to(self.dtype), img_shapes=img_shapes, return_dict=False)[0]  # fmt: skip

    def guide(self, v_cond, v_uncond, scale):
        return cfg_combine(v_cond, v_uncond, scale)


def one_frame_convs(vae: torch.nn.Module) -> int:
    """Make the VAE decoder's causal 3-D convolutions 2-D ones when they see one frame with nothing cached.

    An image is a one-frame video to this VAE: each causal conv pads the frame with two zero frames in front, so of a
    3 x 3 x 3 kernel only the last time slice meets data, and two thirds of the decode's convolution FLOPs multiply
    zeros (2.84 TFLOP per 512^2 image by torch's counter; the decode took 0.49 s for 16 images on an H200, ~0.1 of
    its bf16 peak). The 2-D convolution with that slice gives the same output; video frames, a cache from an earlier
    frame and strided time keep diffusers' own forward. Returns how many convolutions were switched."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    n = 0
    for m in vae.decoder.modules():
        if isinstance(m, QwenImageCausalConv3d) and m.kernel_size[0] > 1 and m.stride[0] == 1 and m.dilation[0] == 1:
            m.forward = types.MethodType(_causal_conv_one_frame, m)
            n += 1
    return n


def _causal_conv_one_frame(conv, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    if x.shape[2] != 1 or cache_x is not None or conv._padding[4] != conv.kernel_size[0] - 1:
        return type(conv).forward(conv, x, cache_x)
    x2 = F.pad(x[:, :, 0], conv._padding[:4])  # (w, w, h, h): the spatial padding; time's is the zero frames
    y = F.conv2d(x2, conv.weight[:, :, -1], conv.bias, conv.stride[1:], 0, conv.dilation[1:], conv.groups)
    return y.unsqueeze(2)


@register_family("QwenImagePipeline")
def parts(pipe, *, height: int, width: int, max_sequence_length: int, guidance_scale: float) -> PipelineParts:
    factor = pipe.vae_scale_factor
    latent = LatentShape(height // factor // 2, width // factor // 2, pipe.transformer.config.in_channels)

    def encode(prompts: list[str]) -> list[Cond]:
        embeds, mask = pipe.encode_prompt(prompt=prompts, device=pipe.device, max_sequence_length=max_sequence_length)
        if mask is None:  # diffusers drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        lengths = mask.sum(-1).tolist()
        return [(embeds[i, : int(n)], mask[i, : int(n)]) for i, n in enumerate(lengths)]

    def decode(latents: torch.Tensor) -> torch.Tensor:
        vae = pipe.vae
        z = pipe._unpack_latents(latents, height, width, factor).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z)
        std = torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z)
        image = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def sigmas(num_steps: int) -> torch.Tensor:
        import numpy as np
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        c = pipe.scheduler.config
        mu = calculate_shift(latent.grid_h * latent.grid_w, c.get("base_image_seq_len", 256),
                             c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                             c.get("max_shift", 1.15))  # fmt: skip
        pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu, device="cpu")
        return pipe.scheduler.sigmas.clone()

    one_frame_convs(pipe.vae)
    adapter = QwenImageAdapter(latent, pipe.transformer.dtype)
    return PipelineParts(adapter, encode, decode, sigmas, latent)
