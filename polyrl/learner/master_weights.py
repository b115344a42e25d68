"""bf16 compute parameters in the module, fp32 master weights in the optimizer (Megatron's mixed precision).

Used by the flow trainer for fp32 LoRA adapters on a bf16 DiT (one process; FSDP2 does the same with several).

Why not leave the adapters in fp32: peft casts a LoRA layer's input to the adapter's dtype, so every adapted linear
turned its [tokens, hidden] bf16 activation into fp32 and ran an fp32 matmul (on Qwen-Image 20B that was a third of
the rollout time, docs/engineering/NOTES_flow.md). Autocast over fp32 weights would avoid the fp32 matmuls but keeps fp32
activations elsewhere (norms, residual adds) and re-casts weights on every forward. With the module's own trainable
parameters in bf16, the forward is the base model's bf16 forward.

What keeps the update exact in fp32:
- each bf16 gradient is added into the fp32 master's `.grad` as soon as it is accumulated (a post-accumulate hook),
  and the bf16 `.grad` is dropped, so micro-batch accumulation happens in fp32;
- the optimizer (AdamW state in fp32) steps the masters; the bf16 weights are then rounded copies of them.
"""

from __future__ import annotations

import torch
from torch import nn


class MasterWeights:
    """Owns fp32 masters of a module's trainable parameters and switches the module to `compute_dtype`."""

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16):
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.compute = [p for p in model.parameters() if p.requires_grad]
        self.master = [nn.Parameter(p.detach().float().clone()) for p in self.compute]
        model.to(compute_dtype)  # frozen parameters and buffers too (LoRA base weights stay frozen in bf16)
        for p, m in zip(self.compute, self.master):
            p.register_post_accumulate_grad_hook(_into_master(m))

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """After an optimizer step: round the fp32 masters into the module's compute weights."""
        torch._foreach_copy_(self.compute, self.master)

    def named(self) -> list[tuple[str, nn.Parameter]]:
        """(the module's parameter name, its fp32 master) pairs; the masters are what the optimizer holds."""
        return list(zip(self.names, self.master))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 trainable weights under the module's parameter names (what a checkpoint must keep)."""
        return {n: m.detach() for n, m in self.named()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for n, m in self.named():
            m.copy_(state[n])
        self.copy_to_model()


def _into_master(master: nn.Parameter):
    def hook(p: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = p.grad.float()
        else:
            master.grad.add_(p.grad)
        p.grad = None

    return hook
