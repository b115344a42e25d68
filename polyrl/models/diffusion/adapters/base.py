"""What a model family must provide to `FlowPolicy`, and the pieces the families share.

A family adapter turns FlowPolicy's neutral view (packed latent tokens [B, L, C], per-sample sigma in [0, 1], cached
per-prompt condition tuples) into one call of its diffusers transformer, and says how CFG combines the branches.
Loading a pipeline gives `PipelineParts`: the adapter plus the prompt encoder, the VAE decoder and the sigma grid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

Cond = tuple[torch.Tensor, ...]  # one prompt's cached condition, e.g. (embeds_TD, mask_T) or (embeds_TD, pooled_D)
EncodeFn = Callable[[list[str]], list[Cond]]


@dataclass
class LatentShape:
    """Packed latent layout: tokens of `channels`, on a grid of (grid_h, grid_w) patches."""

    grid_h: int
    grid_w: int
    channels: int


class FlowAdapter(Protocol):
    """Per-family glue: batch the cached conditions, call the transformer, combine CFG branches."""

    def collate(self, conds: list[Cond]) -> Cond:
        """Per-prompt conditions -> one batch (padding variable-length text where the family needs it)."""
        ...

    def forward(self, module: torch.nn.Module, x: torch.Tensor, sigma_B: torch.Tensor, cond: Cond) -> torch.Tensor:
        """The velocity v ~ eps - x0 for packed latents `x` [B, L, C] at noise level `sigma_B` [B] in [0, 1]."""
        ...

    def guide(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """The guided velocity from the two CFG branches."""
        ...


@dataclass
class PipelineParts:
    """What `load_pipeline_policy` builds a FlowPolicy from."""

    adapter: FlowAdapter
    encode_fn: EncodeFn
    decode_fn: Callable[[torch.Tensor], torch.Tensor]
    sigmas_fn: Callable[[int], torch.Tensor]
    latent: LatentShape


PartsFn = Callable[..., PipelineParts]
FAMILIES: dict[str, PartsFn] = {}


def register_family(pipeline_class: str):
    """Register `parts(pipe, *, height, width, max_sequence_length, guidance_scale) -> PipelineParts` for a
    diffusers pipeline `_class_name` (as written in model_index.json)."""

    def decorator(fn: PartsFn) -> PartsFn:
        if pipeline_class in FAMILIES and FAMILIES[pipeline_class] is not fn:
            raise ValueError(f"pipeline class {pipeline_class!r} already has an adapter; pick another name")
        FAMILIES[pipeline_class] = fn
        return fn

    return decorator


# --------------------------------------------------------------------------- shared pieces


def cfg_plain(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Standard CFG v_u + g (v_c - v_u) (SD3, FLUX true CFG)."""
    return v_uncond + scale * (v_cond - v_uncond)


def stack_conds(conds: list[Cond]) -> Cond:
    """Stack fixed-length conditions field by field (SD3 and FLUX pad their text to max_sequence_length)."""
    return tuple(torch.stack(field) for field in zip(*conds))


def pack_2x2(z_BCHW: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] latents -> [B, (H/2)(W/2), 4C] tokens of 2x2 patches (FluxPipeline._pack_latents' layout)."""
    b, c, h, w = z_BCHW.shape
    z = z_BCHW.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return z.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(x_BLC: torch.Tensor, latent: LatentShape) -> torch.Tensor:
    """Inverse of `pack_2x2`: [B, grid_h * grid_w, 4C] -> [B, C, 2 grid_h, 2 grid_w]."""
    b, c = x_BLC.shape[0], latent.channels // 4
    z = x_BLC.reshape(b, latent.grid_h, latent.grid_w, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return z.reshape(b, c, latent.grid_h * 2, latent.grid_w * 2)


def vae_decode(pipe, z_BCHW: torch.Tensor) -> torch.Tensor:
    """SD3/FLUX AutoencoderKL decode of model-space latents: z / scaling_factor + shift_factor, images in [0, 1]."""
    vae = pipe.vae
    z = z_BCHW.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    image = vae.decode(z, return_dict=False)[0]
    return (image.float() / 2 + 0.5).clamp(0, 1)
