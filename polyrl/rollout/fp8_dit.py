"""FP8 GEMMs in the DiT's sampling forwards (`actor_rollout_ref.rollout.quantization=fp8`); trained forwards stay bf16.

Sampling is ~68% of a Qwen-Image FlowGRPO step and compute-bound (docs/engineering/NOTES_flow.md); Hopper runs e4m3 GEMMs
at twice the bf16 rate. `FP8Sampling(transformer)` gives each selected `nn.Linear` of the transformer blocks a second
path that reads an e4m3 copy of its weight (one fp32 scale per output row) and quantises its input per token at run
time. The numbers come from the LLM engine's code, one implementation: `quantize_weight_rows` makes the weight copy
and `fp8_matmul` (polyrl/rollout/native/fp8_linear.py) runs `torch._scaled_mm` on CUDA and an fp32 emulation of the same
quantise-dequantise arithmetic on CPU (what CI and the quickstart run). The path is picked per call: FP8 inside
`with fp8.sampling():` (the trainer's rollout chunks only), the plain GEMM outside it, so the update, the old-log-prob
recompute, the KL reference and validation see the model's own weights. Parameter names and state dicts do not change
(the e4m3 copies live on this object), so FSDP, LoRA saving and checkpoints are untouched.

Which GEMMs: only the linears inside the blocks. The patch/text embedders, the timestep MLP and the output projection
(it produces the velocity whose Gaussian gives the log-prob, like the LM head on the LLM side) stay in the model
dtype, as does attention (QK^T and PV are ~6% of the FLOPs at 1,152 tokens). On CUDA a linear goes FP8 when its GEMM
pays (`gemm_pays`): fp8_linear's measured decode rule (more than 2^23 weight elements: the bytes saved beat the
quantisation and launch costs), which covers the per-sample modulation linears (M = batch), or, for the token GEMMs
(M = batch x ~1,152 tokens, compute-bound), both sides at least `MIN_FP8_DIM`: quantising the [M, K] input costs ~3
bytes per element of HBM traffic while the GEMM saves 2N multiply-adds per element at half the time, which wins from
N ~ 500 on an H200; 1024 leaves a margin (all of Qwen-Image's block GEMMs are 3072 wide or more). On CPU every block
linear is emulated so that tests cover them all.

LoRA: two ways to meet an adapter. On top (`FP8Sampling(merge_lora=False)`, the mode when the trained steps sample
in FP8): peft's `lora.Linear` calls its `base_layer` (the FP8 GEMM here) and adds B(A x) in the model dtype. The
frozen base never changes, so its e4m3 copy is made once. Merged (`merge_lora=True`, the ODE steps of the default
mode): the copy holds W + scaling * B A, made again before each rollout (0.25 s for Qwen-Image's 20.4B on an H200,
`timing_s/fp8_quantise`), and the adapter's forward is that one GEMM. Merging removes the adapters' side GEMMs and the
extra read and write of the output, but rounds the learned update together with the base:
`benchmarks/probes/flow_fp8_rollout.py --tiny --lora-modes` on CPU (2-block random Qwen-Image, LoRA r8, 10 steps, window 2,
CFG 4) measured max |per-step log-ratio| against the fp32 policy 2.0e-5 on top vs 1.0e-5 merged with a small adapter
(`--lora-scale 0.02`), 1.5e-4 vs 5.4e-4 with a large one (2.0). So the merged copy serves only steps whose log-probs
nobody reads (the ODE steps), and adapters stay on top when the trained steps sample in FP8. On an H200 (compiled,
16 images) FP8 on the ODE steps with merged adapters sampled in 8.15 s, every step FP8 with adapters on top 8.54 s,
bf16 10.55 s. Full fine-tuning changes the base every step. In both cases (`stale`) the trainer drops the copies
after each rollout (`release`: the update gets their 19 GiB back) and `sampling()` makes them again before the next.

Which steps: by default only the deterministic (ODE) steps of a rollout sample in FP8; the trained (SDE) steps run in
the model dtype (`actor_rollout_ref.rollout.fp8_trained_steps=False`). Their log-probs are then the trained
precision's, so pi_old needs no recompute (the forwards it would cost are the ones FP8 saves on 2 of 10 steps) and the
PPO ratio starts at 1. The ODE steps only move the states the window starts from and the image the reward sees:
FlowGRPO's gradient never flows through them, so the estimate stays on-policy for what is trained.
`fp8_trained_steps=True` samples every step in FP8 and recomputes pi_old in the model dtype (`timing_s/old_log_prob`),
which is what measures the mismatch KL and feeds the shared rollout correction.

Memory: the e4m3 copies add one byte per block weight next to the bf16 weights the update needs (19 GiB for
Qwen-Image's 20.4B) while sampling. Copies that training makes stale are released for the update, so its peak is the
bf16 run's; a frozen base's copy (adapters on top) stays for the whole run.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from polyrl.errors import ConfigError
from polyrl.rollout.native.fp8_linear import MIN_FP8_ELEMENTS, fp8_matmul, quantize_weight_rows

MIN_FP8_DIM = 1024  # compute-bound token GEMMs: both sides at least this (module docstring)
QUANTIZATIONS = (None, "fp8")
_KEY = "actor_rollout_ref.rollout.quantization"


def gemm_pays(linear: nn.Linear) -> bool:
    """Whether this linear runs in FP8 when sampling (module docstring); every one on CPU (emulated)."""
    w = linear.weight
    if not w.is_cuda:
        return True
    out_f, in_f = w.shape
    if in_f % 16 or out_f % 16:  # _scaled_mm's alignment
        return False
    return w.numel() > MIN_FP8_ELEMENTS or min(in_f, out_f) >= MIN_FP8_DIM


def block_linears(transformer: nn.Module) -> list[nn.Linear]:
    """The plain linears of the transformer blocks (LoRA's own A/B matrices excluded) that pay in FP8."""
    from polyrl.distributed.parallelize import transformer_blocks

    return [m for blk in transformer_blocks(transformer) for name, m in blk.named_modules()
            if type(m) is nn.Linear and "lora_" not in name and gemm_pays(m)]  # fmt: skip


class FP8Sampling:
    """e4m3 copies of the selected block linears and the switch that routes their forwards through them.

    `merge_lora`: a linear under a LoRA adapter gets the e4m3 copy of W + scaling * B A instead, and its adapter's
    forward runs that one GEMM while sampling (module docstring: the ODE steps of the default mode)."""

    def __init__(self, transformer: nn.Module, merge_lora: bool = False):
        self.linears = block_linears(transformer)
        if not self.linears:
            raise ConfigError(f"{_KEY}=fp8 found no linear layer worth quantising in the transformer blocks; "
                              "leave it unset for this model.")  # fmt: skip
        self.active = False
        adapters = _lora_layers(transformer) if merge_lora else {}
        self.merged = 0
        for lin in self.linears:  # one shared forward and switch: compiled blocks then share one graph per mode
            wrapper = adapters.get(id(lin))
            target = lin if wrapper is None else wrapper
            target._fp8_sampling = self
            target.forward = types.MethodType(_fp8_or_plain_forward if wrapper is None else _merged_or_lora_forward,
                                              target)  # fmt: skip
            lin.__dict__["_fp8_lora"] = wrapper  # not a registered submodule (it is the linear's parent)
            self.merged += wrapper is not None
        self.refresh()

    @property
    def stale(self) -> bool:
        """True when a quantised weight is trained (full fine-tuning), or its copy holds a trained LoRA adapter
        (merged): the copy must be redone before sampling."""
        return any(lin.weight.requires_grad or (lin._fp8_lora is not None and _trains(lin._fp8_lora))
                   for lin in self.linears)  # fmt: skip

    @torch.no_grad()
    def refresh(self) -> None:
        """The e4m3 copies, kept on each linear as plain attributes: not buffers, so state dicts and `.to(dtype)`
        never see them."""
        for lin in self.linears:
            w = lin.weight.detach()
            if lin._fp8_lora is not None:
                w = _merged_weight(lin._fp8_lora, w)
            lin.fp8_weight, lin.fp8_scale = quantize_weight_rows(w)
        self.fresh = True

    def prepare(self) -> None:
        """Make the copies if `release` dropped them."""
        if not self.fresh:
            self.refresh()

    def release(self) -> None:
        """After a rollout: drop copies that training will make stale anyway (trained weights or merged adapters), so
        the update has their memory (19 GiB for Qwen-Image); the next `sampling()` makes them again."""
        if self.stale:
            for lin in self.linears:
                lin.fp8_weight = lin.fp8_scale = None
            self.fresh = False

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """FP8 GEMMs for the forwards inside (making the copies first after a `release`). Trained weights are
        re-quantised only there: the trainer releases after every rollout, so a copy never outlives an update."""
        self.prepare()
        self.active = True
        try:
            yield
        finally:
            self.active = False

    @contextlib.contextmanager
    def plain(self) -> Iterator[None]:
        """The model dtype's GEMMs for the forwards inside, within `sampling()` (a trained step's forward)."""
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was


def _fp8_or_plain_forward(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A selected linear's forward: the e4m3 GEMM while its FP8Sampling is active, the plain one otherwise.

    One function for every linear, reading its state from the module: a closure per linear (or a dict keyed by
    module) makes dynamo guard on that linear's identity, so each compiled block recompiled for FP8 and a 60-block
    DiT fell back to eager past the recompile limit (test_compiled_fp8_blocks_share_one_graph_per_mode)."""
    if not lin._fp8_sampling.active:
        return F.linear(x, lin.weight, lin.bias)
    return fp8_matmul(x, lin.fp8_weight, lin.fp8_scale, lin.bias, lin.weight.dtype)


def _merged_or_lora_forward(lora: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A LoRA layer's forward over a merged e4m3 copy: while sampling (adapters on), the one FP8 GEMM of
    W + scaling * B A; otherwise peft's own forward over the plain base GEMM."""
    base = lora.base_layer
    if lora._fp8_sampling.active and not lora.disable_adapters and not lora.merged:
        return fp8_matmul(x, base.fp8_weight, base.fp8_scale, base.bias, base.weight.dtype)
    return type(lora).forward(lora, x, *args, **kwargs)


def _lora_layers(transformer: nn.Module) -> dict[int, nn.Module]:
    """id(base linear) -> the peft LoRA layer wrapping it."""
    return {id(m.base_layer): m for m in transformer.modules()
            if hasattr(m, "lora_A") and isinstance(getattr(m, "base_layer", None), nn.Linear)}  # fmt: skip


def _trains(lora: nn.Module) -> bool:
    return any(p.requires_grad for p in lora.parameters())


def _merged_weight(lora: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """W + sum over the active adapters of scaling * B A, in W's dtype (one addmm per adapter)."""
    for name in lora.active_adapters:
        if name in lora.lora_A:
            a, b = lora.lora_A[name].weight, lora.lora_B[name].weight
            w = torch.addmm(w, b.to(w.dtype), a.to(w.dtype), alpha=lora.scaling[name])
    return w


def check_quantization(value: str | None, world_size: int, trained_steps: bool = False) -> None:
    """Refuse values the DiT rollout cannot honour, with the key and the fix."""
    if trained_steps and value != "fp8":
        raise ConfigError("actor_rollout_ref.rollout.fp8_trained_steps=True only applies to FP8 sampling; set "
                          f"{_KEY}=fp8 or drop the key.")  # fmt: skip
    if value not in QUANTIZATIONS:
        raise ConfigError(f"{_KEY}={value!r} is not supported for diffusion models; use fp8 or leave it unset.")
    if value == "fp8" and world_size > 1:
        raise ConfigError(f"{_KEY}=fp8 runs in one process only (the e4m3 copies are of whole weights, FSDP2 shards "
                          "them); leave it unset with trainer.n_gpus_per_node > 1.")  # fmt: skip


def build(value: str | None, transformer: nn.Module, world_size: int = 1,
          trained_steps: bool = False) -> FP8Sampling | None:
    """The FP8 sampler state for `rollout.quantization`, or None when the key is unset. With FP8 on the ODE steps
    only (`trained_steps` False) LoRA adapters are merged into the e4m3 copies (module docstring)."""
    check_quantization(value, world_size, trained_steps)
    return FP8Sampling(transformer, merge_lora=not trained_steps) if value == "fp8" else None


def rollout_precision(fp8: FP8Sampling | None):
    """The context the rollout forwards run in: FP8 GEMMs when configured, else nothing."""
    return fp8.sampling() if fp8 is not None else contextlib.nullcontext()


def step_precision(fp8: FP8Sampling | None, trained_steps: bool):
    """`sde_sampler.sample`'s per-step context inside `rollout_precision`: the trained (SDE) steps leave FP8 unless
    `trained_steps` (`rollout.fp8_trained_steps`; module docstring); None when every step keeps the rollout's."""
    if fp8 is None or trained_steps:
        return None
    return lambda trained: fp8.plain() if trained else contextlib.nullcontext()
