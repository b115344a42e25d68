"""Flow models behind one interface: `FlowPolicy.velocity(x, sigma_B, prompts)` plus prompt cache, decode and grid.

One class serves the quickstart's tiny transformer and diffusers pipelines loaded with `from_pretrained(local_dir)`
(`QwenImagePipeline`, `StableDiffusion3Pipeline`, `FluxPipeline`); what differs per family (how the transformer is
called, how CFG combines, prompt encoder, decoder, sigma grid) lives in a small adapter in `polyrl/models/diffusion/adapters/`,
registered by the pipeline's `_class_name`.

- Prompt embeddings are computed once per distinct prompt and cached on the policy's device. The trainer clears the
  cache at each rollout unless `actor_rollout_ref.model.cache_prompt_embeds=True`: VeRL-Omni's rollout encodes each
  request's prompt and hands the embeddings to the actor for that step's training passes; nothing survives the step.
- CFG: with `true_cfg_scale > 1` one forward runs the batch [positive; negative] and the adapter combines
  v = v_u + g (v_c - v_u) (Qwen-Image then rescales per token, v *= |v_c| / |v|). Gradients flow through both
  branches (flow_grpo Qwen-Image and verl-omni; flow_grpo SD3 detaches the unconditional one). FLUX.1-dev's guidance
  embedding is not CFG: `rollout.pipeline.guidance_scale` goes into every call.
- The reference policy is the same module with LoRA adapters disabled, or a frozen copy for full fine-tuning.
- `decode` (the VAE) runs only to score rewards, never inside the sampling loop.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from polyrl.errors import ConfigError
from polyrl.models.diffusion.adapters import FAMILIES, EncodeFn, FlowAdapter, LatentShape, QwenImageAdapter, cfg_combine
from polyrl.utils.device import to_dtype

# The text encoder meets a new prompt length nearly every step. cuDNN's attention (an SDPA backend torch picks on
# Hopper) builds an execution plan for each new shape: 1.09 s of CPU over the 28 layers of Qwen-Image's 7B encoder on
# an H200, a 2.3 s prompt encoding in a 13 s FlowGRPO step (torch profiler, benchmarks/probes/flow_session.sh encode5,
# 2026-11-26). Flash and memory-efficient attention need no plan.
TEXT_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

__all__ = ["EncodeFn", "FlowPolicy", "LatentShape", "cfg_combine", "load_pipeline_policy"]


class FlowPolicy:
    """A diffusers flow transformer as a policy; the family `adapter` knows how to call it (Qwen-Image's by default)."""

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
        adapter: FlowAdapter | None = None,
    ):
        self.transformer = transformer
        self.encode_fn, self.decode_fn, self.sigmas_fn = encode_fn, decode_fn, sigmas_fn
        self.latent = latent
        self.true_cfg_scale = true_cfg_scale
        self.negative_prompt = negative_prompt
        self.device = torch.device(device)
        self.dtype = next(transformer.parameters()).dtype
        self.adapter = adapter if adapter is not None else QwenImageAdapter(latent, self.dtype)
        self._cache: dict[str, tuple[torch.Tensor, ...]] = {}
        self._ref_copy: torch.nn.Module | None = None
        self.is_lora = False

    def compute_in(self, dtype: torch.dtype) -> None:
        """Feed the transformer `dtype` inputs: its weights compute in `dtype` while fp32 copies are trained
        (`fsdp_config.mixed_precision.param_dtype`; FlowGRPOTrainer)."""
        self.dtype = self.adapter.dtype = dtype
        self._cache.clear()
        if self._ref_copy is not None:  # full fine-tuning's frozen reference computes in it too
            self._ref_copy.to(dtype)

    # ------------------------------------------------------------------ prompts

    def cache_prompts(self, prompts: list[str]) -> None:
        """Encode the prompts not seen before (plus the negative prompt when CFG is on)."""
        wanted = list(dict.fromkeys(prompts + ([self.negative_prompt] if self.true_cfg_scale > 1 else [])))
        missing = [p for p in wanted if p not in self._cache]
        if missing:
            with torch.no_grad(), sdpa_kernel(TEXT_ATTENTION):
                for p, cond in zip(missing, self.encode_fn(missing)):
                    self._cache[p] = tuple(t.to(self.device, self.dtype if t.is_floating_point() else t.dtype)
                                           for t in cond)  # fmt: skip

    def clear_prompt_cache(self) -> None:
        """Forget every prompt embedding: the next use runs the text encoder again."""
        self._cache.clear()

    def prompt_batch(self, prompts: list[str]) -> tuple[torch.Tensor, ...]:
        """The batched condition of `prompts` (Qwen-Image: embeds [B, T, D] and mask [B, T])."""
        self.cache_prompts(prompts)
        return self.adapter.collate([self._cache[p] for p in prompts])

    # ------------------------------------------------------------------ model

    def noise(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        shape = (batch, self.latent.grid_h * self.latent.grid_w, self.latent.channels)
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device, self.dtype)

    def velocity(self, x: torch.Tensor, sigma_B: torch.Tensor, prompts: list[str], *, reference: bool = False):
        """The (guided) velocity in fp32; `reference=True` evaluates the reference policy (no grad)."""
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
                return self.adapter.forward(module, x, sigma_B, self.prompt_batch(prompts)).float()
            # one forward over the batch [positive; negative]
            cond = self.prompt_batch(prompts + [self.negative_prompt] * x.shape[0])
            v = self.adapter.forward(module, torch.cat([x, x]), torch.cat([sigma_B, sigma_B]), cond).float()
            v_cond, v_uncond = v.chunk(2)
            return self.adapter.guide(v_cond, v_uncond, self.true_cfg_scale)

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
        for p in self.transformer.parameters():  # adapters train in fp32 (diffusers' cast_training_params); on a
            if p.requires_grad:  # bf16 base the trainer computes them in bf16 from fp32 masters (master_weights.py)
                p.data = p.data.float()
        self.is_lora = True

    def make_reference(self) -> None:
        """Full fine-tuning with KL: keep a frozen copy of the initial weights (LoRA needs none)."""
        if not self.is_lora and self._ref_copy is None:
            self._ref_copy = copy.deepcopy(self.transformer).requires_grad_(False).eval()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def compile_blocks(self, no_grad: bool = True) -> None:
        """`torch.compile` each transformer block: static-shape graphs, one per batch shape, for the passes with grad
        (the update) and for those without (rollout, reference, validation; `no_grad=False`
        leaves them eager).

        Per block, as for the LLM (training/actor.py): identical blocks share one graph and parameter names do not
        change. Measured on an H200 (Qwen-Image 20B, LoRA r64, CFG 4, 16 images): the update runs ~27% faster
        compiled; the rollout, in chunks of 8 images, takes 15.3 s eager, 12.0 s with static-shape graphs and 22.3 s
        with a dynamic-shape one; in chunks of 16, 11.4 s static and 13.1 s with `dynamic=None` (static until a shape
        changes). Hence static graphs for the rollout, and since 2026-11-26 for the update too (below).
        Call after `add_lora` so the adapters are inside the compiled blocks."""
        from polyrl.distributed.parallelize import transformer_blocks

        # Every block and both modes run one code object, whose graphs dynamo counts together against
        # `recompile_limit` (8): static batch shapes x text-length buckets x masked/unmasked prompts x grad mode pass
        # it, after which dynamo runs the block eagerly, and a checkpointed block whose forward ran compiled but
        # whose recompute ran eager fails ("Recomputed values ... have different metadata"; full fine-tuning on 4
        # H200s, 2026-11-26, reproduced on CPU by `torchrun --nproc_per_node=2 benchmarks/flow_grpo.py --tiny --full
        # --no-cfg --compile --micro 16 --rollout-micro 32 --steps 2`).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        for block in transformer_blocks(self.transformer):
            eager = block.forward
            plain = torch.compile(eager, dynamic=False) if no_grad else eager  # one graph per batch shape
            block.forward = _grad_mode_switch(torch.compile(eager, dynamic=False), plain)


RECOMPILE_LIMIT = 64  # graphs per block code object (compile_blocks)
# The update's graphs: one static graph per shape, as the rollout's; one dynamic-shape graph for all was the default
# until 2026-11-26. Qwen-Image LoRA, 16 images, one H200: static updates took 4.8 / 4.8 / 4.8 s in three timed steps
# (1.208 img/GPU/s); dynamic ones 4.8-6.0 s, the slow one on whichever step first met a text length in the timed run,
# though a warm-up had updated on every text bucket (benchmarks/probes/flow_session.sh update_static and workers).


def _grad_mode_switch(compiled, no_grad):
    def forward(*args, **kwargs):
        return (compiled if torch.is_grad_enabled() else no_grad)(*args, **kwargs)

    return forward


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
                         negative_prompt: str = " ", max_sequence_length: int = 256, guidance_scale: float = 3.5,
                         dtype: str = "float32", device: str | torch.device = "cpu") -> FlowPolicy:  # fmt: skip
    """The diffusers pipeline saved in `path` as a FlowPolicy, through the adapter registered for its `_class_name`
    (text encoders used once per prompt, VAE only for rewards)."""
    import json
    from pathlib import Path

    index = Path(path) / "model_index.json"
    if not index.is_file():
        raise ConfigError(
            f"actor_rollout_ref.model.path={path!r} is not a diffusers pipeline directory (no model_index.json); "
            "pass a folder written by pipeline.save_pretrained()."
        )
    cls_name = json.loads(index.read_text()).get("_class_name")
    if cls_name not in FAMILIES:
        raise ConfigError(
            f"actor_rollout_ref.model.path={path!r} holds a {cls_name}; supported pipelines are {sorted(FAMILIES)}."
        )
    torch_dtype = to_dtype(dtype, "actor_rollout_ref.model.dtype")
    import diffusers

    pipe = getattr(diffusers, cls_name).from_pretrained(path, torch_dtype=torch_dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    multiple = pipe.vae_scale_factor * 2  # every family packs (or patchifies) 2x2 latent patches
    if height % multiple or width % multiple:
        raise ConfigError(
            f"rollout.pipeline.height/width={height}x{width} must be multiples of {multiple} for this pipeline."
        )
    parts = FAMILIES[cls_name](pipe, height=height, width=width, max_sequence_length=max_sequence_length,
                               guidance_scale=guidance_scale)  # fmt: skip
    policy = FlowPolicy(pipe.transformer, encode_fn=parts.encode_fn, decode_fn=parts.decode_fn,
                        sigmas_fn=parts.sigmas_fn, latent=parts.latent, true_cfg_scale=true_cfg_scale,
                        negative_prompt=negative_prompt, device=device, adapter=parts.adapter)  # fmt: skip
    policy.pipe = pipe
    return policy
