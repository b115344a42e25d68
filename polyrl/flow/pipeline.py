"""Flow models behind one interface: `FlowPolicy.velocity(x, sigma_B, prompts)` plus prompt cache, decode and grid.

One class serves the quickstart's tiny transformer and a real `QwenImagePipeline` loaded with
`from_pretrained(local_dir)`; what differs (prompt encoder, decoder, sigma grid) is passed in as functions.

- Prompt embeddings are computed once per distinct prompt and cached on the policy's device (the text encoder never
  runs again; for real pipelines it can then be freed).
- CFG: with `true_cfg_scale > 1` one forward runs the batch [negative; positive] and combines
  v = v_u + g (v_c - v_u), then Qwen-Image's per-token norm rescale v *= |v_c| / |v|. Gradients flow through both
  branches (flow_grpo Qwen-Image and verl-omni; flow_grpo SD3 detaches the unconditional one).
- The reference policy is the same module with LoRA adapters disabled, or a frozen copy for full fine-tuning.
- `decode` (the VAE) runs only to score rewards, never inside the sampling loop.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from polyrl.errors import ConfigError
from polyrl.utils.device import to_dtype

EncodeFn = Callable[[list[str]], list[tuple[torch.Tensor, torch.Tensor]]]  # prompts -> [(embeds_TD, mask_T)]


def cfg_combine(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """True CFG with Qwen-Image's rescale: the guided velocity keeps the conditional branch's per-token norm."""
    guided = v_uncond + scale * (v_cond - v_uncond)
    return guided * (v_cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True).clamp_min(1e-12))


def pad_prompts(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad variable-length prompt embeddings to one [B, T, D] batch and its [B, T] mask."""
    t_max = max(e.shape[0] for e, _ in items)
    embeds = items[0][0].new_zeros(len(items), t_max, items[0][0].shape[-1])
    mask = torch.zeros(len(items), t_max, dtype=torch.long, device=embeds.device)
    for i, (e, m) in enumerate(items):
        embeds[i, : e.shape[0]] = e
        mask[i, : m.shape[0]] = m
    return embeds, mask


@dataclass
class LatentShape:
    """Packed latent layout: tokens of `channels`, on a grid of (grid_h, grid_w) patches."""

    grid_h: int
    grid_w: int
    channels: int


class FlowPolicy:
    """A Qwen-Image-style transformer (packed latents, text embeds + mask, RoPE over img_shapes) as a flow policy."""

    def __init__(
        self,
        transformer: torch.nn.Module,
        *,
        encode_fn: EncodeFn,
        decode_fn: Callable[[torch.Tensor], torch.Tensor],
        sigmas_fn: Callable[[int], torch.Tensor],
        latent: LatentShape,
        true_cfg_scale: float = 1.0,
        negative_prompt: str = " ",
        device: str | torch.device = "cpu",
    ):
        self.transformer = transformer
        self.encode_fn, self.decode_fn, self.sigmas_fn = encode_fn, decode_fn, sigmas_fn
        self.latent = latent
        self.true_cfg_scale = true_cfg_scale
        self.negative_prompt = negative_prompt
        self.device = torch.device(device)
        self.dtype = next(transformer.parameters()).dtype
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._ref_copy: torch.nn.Module | None = None
        self.is_lora = False

    # ------------------------------------------------------------------ prompts

    def cache_prompts(self, prompts: list[str]) -> None:
        """Encode the prompts not seen before (plus the negative prompt when CFG is on)."""
        wanted = list(dict.fromkeys(prompts + ([self.negative_prompt] if self.true_cfg_scale > 1 else [])))
        missing = [p for p in wanted if p not in self._cache]
        if missing:
            with torch.no_grad():
                for p, (e, m) in zip(missing, self.encode_fn(missing)):
                    self._cache[p] = (e.to(self.device, self.dtype), m.to(self.device))

    def prompt_batch(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache_prompts(prompts)
        return pad_prompts([self._cache[p] for p in prompts])

    # ------------------------------------------------------------------ model

    def noise(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        shape = (batch, self.latent.grid_h * self.latent.grid_w, self.latent.channels)
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device, self.dtype)

    def _forward(self, module, x, sigma_B, embeds, mask):
        img_shapes = [[(1, self.latent.grid_h, self.latent.grid_w)]] * x.shape[0]
        return module(hidden_states=x.to(self.dtype), encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
                      timestep=sigma_B.to(self.dtype), img_shapes=img_shapes, return_dict=False)[0]  # fmt: skip

    def velocity(self, x: torch.Tensor, sigma_B: torch.Tensor, prompts: list[str], *, reference: bool = False):
        """The (guided) velocity in fp32; `reference=True` evaluates the reference policy (no grad)."""
        embeds, mask = self.prompt_batch(prompts)
        module = self.transformer
        ctx = contextlib.nullcontext()
        if reference:
            ctx = torch.no_grad()
            if self.is_lora:
                module = _AdaptersOff(self.transformer)
            else:
                if self._ref_copy is None:
                    raise ConfigError(
                        "actor_rollout_ref.actor.use_kl_loss=True with full fine-tuning needs the reference copy; "
                        "call FlowPolicy.make_reference() first (the trainer does)."
                    )
                module = self._ref_copy
        with ctx:
            if self.true_cfg_scale <= 1:
                return self._forward(module, x, sigma_B, embeds, mask).float()
            neg_e, neg_m = self.prompt_batch([self.negative_prompt] * x.shape[0])
            both_e, both_m = _pad_pair(embeds, neg_e), _pad_pair(mask, neg_m)
            v = self._forward(module, torch.cat([x, x]), torch.cat([sigma_B, sigma_B]), both_e, both_m).float()
            v_cond, v_uncond = v.chunk(2)
            return cfg_combine(v_cond, v_uncond, self.true_cfg_scale)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images [B, C, H, W] in [0, 1] for the reward functions."""
        with torch.no_grad():
            return self.decode_fn(latents)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return self.sigmas_fn(num_steps).float().cpu()

    # ------------------------------------------------------------------ training setup

    def add_lora(self, rank: int, alpha: int, target_modules: list[str], init: str | bool = "gaussian") -> None:
        """Freeze the base weights and add a peft LoRA adapter on `target_modules` (diffusers' PEFT integration)."""
        from peft import LoraConfig

        present = {name.rsplit(".", 1)[-1] for name, _ in self.transformer.named_modules()}
        full_names = {name for name, _ in self.transformer.named_modules()}
        found = [t for t in target_modules if t in present or any(n.endswith("." + t) for n in full_names)]
        if not found:
            raise ConfigError(
                f"actor_rollout_ref.model.target_modules={target_modules} matches no module of the transformer; "
                "use names such as to_q, to_k, to_v, to_out.0."
            )
        self.transformer.requires_grad_(False)
        init_w = True if init in (True, "true", "kaiming") else init
        self.transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=found, init_lora_weights=init_w))
        self.is_lora = True

    def make_reference(self) -> None:
        """Full fine-tuning with KL: keep a frozen copy of the initial weights (LoRA needs none)."""
        if not self.is_lora and self._ref_copy is None:
            self._ref_copy = copy.deepcopy(self.transformer).requires_grad_(False).eval()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]


def _pad_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Concatenate two [B, T, ...] tensors along batch after right-padding the shorter T with zeros."""
    t = max(a.shape[1], b.shape[1])

    def pad(x):
        if x.shape[1] == t:
            return x
        extra = x.new_zeros(x.shape[0], t - x.shape[1], *x.shape[2:])
        return torch.cat([x, extra], dim=1)

    return torch.cat([pad(a), pad(b)])


class _AdaptersOff(torch.nn.Module):
    """Calls the wrapped diffusers model with its LoRA adapters disabled (the reference policy)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kw):
        self.model.disable_adapters()
        try:
            return self.model(**kw)
        finally:
            self.model.enable_adapters()


# --------------------------------------------------------------------------- diffusers pipelines from a local directory

def load_pipeline_policy(path: str, *, height: int, width: int, true_cfg_scale: float = 1.0,
                         negative_prompt: str = " ", max_sequence_length: int = 256, dtype: str = "float32",
                         device: str | torch.device = "cpu") -> FlowPolicy:  # fmt: skip
    """A `QwenImagePipeline` saved in `path` as a FlowPolicy (text encoder used once per prompt, VAE for rewards)."""
    from pathlib import Path

    if not (Path(path) / "model_index.json").is_file():
        raise ConfigError(
            f"actor_rollout_ref.model.path={path!r} is not a diffusers pipeline directory (no model_index.json); "
            "pass a folder written by pipeline.save_pretrained()."
        )
    torch_dtype = to_dtype(dtype, "actor_rollout_ref.model.dtype")
    import json

    cls_name = json.loads((Path(path) / "model_index.json").read_text()).get("_class_name")
    if cls_name != "QwenImagePipeline":
        raise ConfigError(
            f"actor_rollout_ref.model.path={path!r} holds a {cls_name}; only QwenImagePipeline is supported so far "
            "(SD3 and FLUX adapters are not written yet)."
        )
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(path, torch_dtype=torch_dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    factor = pipe.vae_scale_factor
    if height % (factor * 2) or width % (factor * 2):
        raise ConfigError(
            f"rollout.pipeline.height/width={height}x{width} must be multiples of {factor * 2} for this pipeline."
        )
    grid_h, grid_w = height // factor // 2, width // factor // 2

    def encode(prompts: list[str]):
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
        mu = calculate_shift(grid_h * grid_w, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))  # fmt: skip
        pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu, device="cpu")
        return pipe.scheduler.sigmas.clone()

    policy = FlowPolicy(pipe.transformer, encode_fn=encode, decode_fn=decode, sigmas_fn=sigmas,
                        latent=LatentShape(grid_h, grid_w, pipe.transformer.config.in_channels),
                        true_cfg_scale=true_cfg_scale, negative_prompt=negative_prompt, device=device)  # fmt: skip
    policy.pipe = pipe
    return policy
