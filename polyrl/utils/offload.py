"""A frozen module kept in pinned host memory and brought to the GPU only while it runs (a text encoder that must
make room for a reward model on the same GPU). Loading is one host-to-device copy per tensor from pinned memory;
releasing copies nothing back (the weights never change), it only points the module at its host copies again."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class FrozenOffload:
    def __init__(self, module: nn.Module):
        self.tensors = list(module.parameters()) + list(module.buffers())
        pin = torch.cuda.is_available()
        self.host = [torch.empty_like(t, device="cpu", pin_memory=pin).copy_(t.detach()) for t in self.tensors]
        self.release()

    def load(self, device) -> None:
        for t, h in zip(self.tensors, self.host):
            t.data = h.to(device, non_blocking=True)

    def release(self) -> None:
        for t, h in zip(self.tensors, self.host):
            t.data = h

    @contextmanager
    def on(self, device):
        self.load(device)
        try:
            yield
        finally:
            self.release()
