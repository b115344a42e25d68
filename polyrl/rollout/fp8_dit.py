"""FP8 GEMMs in the DiT's sampling forwards (`actor_rollout_ref.rollout.quantization=fp8`); trained forwards stay bf16.

Sampling is ~68% of a Qwen-Image FlowGRPO step and compute-bound (benchmarks/NOTES_flow.md); Hopper runs e4m3 GEMMs
at twice the bf16 rate. `FP8Sampling(transformer)` gives each selected `nn.Linear` of the transformer blocks a second
path that reads an e4m3 copy of its weight (one fp32 scale per output row) and quantises its input per token at run
time. The numbers come from the LLM engine's code, one implementation: `quantize_fp8_rows` makes the weight copy and
`fp8_matmul` (polyrl/rollout/native/fp8_linear.py) runs `torch._scaled_mm` on CUDA and an fp32 emulation of the same
quantise-dequantise arithmetic on CPU (what CI and the quickstart run). The path is picked per call: FP8 inside
`with fp8.sampling():` (the trainer's rollout chunks only), the plain GEMM outside it, so the update, the old-log-prob
recompute, the KL reference and validation see the model's own weights. Parameter names and state dicts do not change
(the e4m3 copies live on this object), so FSDP, LoRA saving and checkpoints are untouched.

Which GEMMs: only the linears inside the blocks. The patch/text embedders, the timestep MLP and the output projection
(it produces the velocity whose Gaussian gives the log-prob, like the LM head on the LLM side) stay in the model
dtype, as does attention (QK^T and PV are ~6% of the FLOPs at 1,152 tokens). On CUDA a linear goes FP8 when its GEMM
pays (`gemm_pays`): fp8_linear's measured decode rule (more than 2^24 weight elements: the bytes saved beat the
quantisation launch), which covers the per-sample modulation linears (M = batch), or, for the token GEMMs
(M = batch x ~1,152 tokens, compute-bound), both sides at least `MIN_FP8_DIM`: quantising the [M, K] input costs ~3
bytes per element of HBM traffic while the GEMM saves 2N multiply-adds per element at half the time, which wins from
N ~ 500 on an H200; 1024 leaves a margin (all of Qwen-Image's block GEMMs are 3072 wide or more). On CPU every block
linear is emulated so that tests cover them all.

LoRA: peft's `lora.Linear` calls its `base_layer` (the FP8 GEMM here) and adds B(A x) in the model dtype on top. The
frozen base never changes, so its e4m3 copy is made once and nothing is re-quantised after an optimizer step. The
other choice merges the adapters into the base and re-quantises after every optimizer step, rounding the learned
update together with the base. `benchmarks/flow_fp8_rollout.py --tiny --lora-modes` on CPU (2-block random
Qwen-Image, LoRA r8, 10 steps, window 2, CFG 4): with a small adapter both modes differ from the fp32 policy alike
(max |log-ratio| per step 2.0e-5 on top, 1.0e-5 merged), with a large one the merged mode's error is 3.5x larger
(1.5e-4 vs 5.4e-4; KL 4.1e-5 vs 6.5e-5): adapters on top keep the mismatch independent of how far training has moved
them. Re-quantising costs little (1.7 ms per step there; ~20-40 ms of HBM traffic for 20B on an H200) and merging
would save the adapters' bf16 side GEMMs in sampling (r64 adds ~4% to each adapted GEMM's FLOPs); the GPU run of the
same script times both, and the mode is a one-function change if merging wins there. Full fine-tuning changes the
base every step: `sampling()` re-quantises the trainable weights first (`stale`).

Which steps: by default only the deterministic (ODE) steps of a rollout sample in FP8; the trained (SDE) steps run in
the model dtype (`actor_rollout_ref.rollout.fp8_trained_steps=False`). Their log-probs are then the trained
precision's, so pi_old needs no recompute (the forwards it would cost are the ones FP8 saves on 2 of 10 steps) and the
PPO ratio starts at 1. The ODE steps only move the states the window starts from and the image the reward sees:
FlowGRPO's gradient never flows through them, so the estimate stays on-policy for what is trained.
`fp8_trained_steps=True` samples every step in FP8 and recomputes pi_old in the model dtype (`timing_s/old_log_prob`),
which is what measures the mismatch KL and feeds the shared rollout correction.

Memory: the e4m3 copies add one byte per block weight next to the bf16 weights the update needs (19 GiB for
Qwen-Image's 20.4B).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from polyrl.errors import ConfigError
from polyrl.rollout.native.attention import quantize_fp8_rows
from polyrl.rollout.native.fp8_linear import MIN_FP8_ELEMENTS, fp8_matmul

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
    """e4m3 copies of the selected block linears and the switch that routes their forwards through them."""

    def __init__(self, transformer: nn.Module):
        self.linears = block_linears(transformer)
        if not self.linears:
            raise ConfigError(f"{_KEY}=fp8 found no linear layer worth quantising in the transformer blocks; "
                              "leave it unset for this model.")  # fmt: skip
        self.active = False
        for lin in self.linears:  # one shared forward and switch: compiled blocks then share one graph per mode
            lin._fp8_sampling = self
            lin.forward = types.MethodType(_fp8_or_plain_forward, lin)
        self.refresh()

    @property
    def stale(self) -> bool:
        """True when a quantised weight is trained (full fine-tuning): its copy must be redone before sampling."""
        return any(lin.weight.requires_grad for lin in self.linears)

    @torch.no_grad()
    def refresh(self) -> None:
        """The e4m3 copies, kept on each linear as plain attributes: not buffers, so state dicts and `.to(dtype)`
        never see them."""
        for lin in self.linears:
            lin.fp8_weight, lin.fp8_scale = quantize_fp8_rows(lin.weight.detach())

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """FP8 GEMMs for the forwards inside (re-quantising trained weights first)."""
        if self.stale:
            self.refresh()
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


def check_quantization(value: str | None, world_size: int) -> None:
    """Refuse values the DiT rollout cannot honour, with the key and the fix."""
    if value not in QUANTIZATIONS:
        raise ConfigError(f"{_KEY}={value!r} is not supported for diffusion models; use fp8 or leave it unset.")
    if value == "fp8" and world_size > 1:
        raise ConfigError(f"{_KEY}=fp8 runs in one process only (the e4m3 copies are of whole weights, FSDP2 shards "
                          "them); leave it unset with trainer.n_gpus_per_node > 1.")  # fmt: skip


def build(value: str | None, transformer: nn.Module, world_size: int = 1) -> FP8Sampling | None:
    """The FP8 sampler state for `rollout.quantization`, or None when the key is unset."""
    check_quantization(value, world_size)
    return FP8Sampling(transformer) if value == "fp8" else None


def rollout_precision(fp8: FP8Sampling | None):
    """The context the rollout forwards run in: FP8 GEMMs when configured, else nothing."""
    return fp8.sampling() if fp8 is not None else contextlib.nullcontext()


def step_precision(fp8: FP8Sampling | None, trained_steps: bool):
    """`sde_sampler.sample`'s per-step context inside `rollout_precision`: the trained (SDE) steps leave FP8 unless
    `trained_steps` (`rollout.fp8_trained_steps`; module docstring); None when every step keeps the rollout's."""
    if fp8 is None or trained_steps:
        return None
    return lambda trained: fp8.plain() if trained else contextlib.nullcontext()
