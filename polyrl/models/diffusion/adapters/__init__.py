"""Model families behind FlowPolicy, one small module each, registered by the diffusers pipeline `_class_name`.

- `qwenimage`: QwenImagePipeline (true CFG with per-token norm rescale; also the quickstart's tiny transformer).
- `sd3`: StableDiffusion3Pipeline (unpacked latents inside the adapter, timestep = 1000 sigma, plain CFG).
- `flux`: FluxPipeline (RoPE ids, timestep = sigma, guidance embedding for FLUX.1-dev, plain true CFG).

`base` holds the adapter protocol, `PipelineParts` and the shared pieces (2x2 packing, plain CFG, VAE decode).
"""

from polyrl.models.diffusion.adapters import flux, qwenimage, sd3  # noqa: F401  (registers the families)
from polyrl.models.diffusion.adapters.base import (
    FAMILIES,
    Cond,
    EncodeFn,
    FlowAdapter,
    LatentShape,
    PipelineParts,
    cfg_plain,
    pack_2x2,
    register_family,
    unpack_2x2,
)
from polyrl.models.diffusion.adapters.qwenimage import QwenImageAdapter, cfg_combine

__all__ = [
    "FAMILIES",
    "Cond",
    "EncodeFn",
    "FlowAdapter",
    "LatentShape",
    "PipelineParts",
    "QwenImageAdapter",
    "cfg_combine",
    "cfg_plain",
    "pack_2x2",
    "register_family",
    "unpack_2x2",
]
