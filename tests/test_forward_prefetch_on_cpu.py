"""`fsdp_config.forward_prefetch` on 2 gloo processes: the blocks are told to prefetch their successor, and the
forward/backward results are those without prefetch (prefetch changes when all-gathers run, never what they gather).

The speed-up needs GPUs (overlap of all-gather and compute); on 2 GPUs compare benchmarks/grpo_step.py with
`actor_rollout_ref.actor.fsdp_config.forward_prefetch=True` against the default.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp
from torch import nn

from polyrl.learner.config import FSDPConfig


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _run(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from polyrl.distributed.parallelize import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    results = {}
    for prefetch in (False, True):
        torch.manual_seed(0)
        model = _Stack()
        parallelize(model, mesh, FSDPConfig(forward_prefetch=prefetch), torch.device("cpu"))
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
        y = model(x)
        y.sum().backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]
        targets = [len(b._get_fsdp_state()._states_to_forward_prefetch) for b in model.layers]
        results[prefetch] = (y.detach(), grads, targets)
    if rank == 0:
        out.update(results)
    del model, y, grads, results
    dist.barrier()  # neither rank tears gloo down while the other still talks to it
    dist.destroy_process_group()
    # gloo's worker threads can abort a finalizing interpreter ("terminate called without an active exception",
    # SIGABRT; pytorch/pytorch#179291; seen in CI after this test's results were in): skip finalization
    os._exit(0)


def test_forward_prefetch_sets_successors_and_keeps_results():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_run, args=(port, out), nprocs=2)
    (y0, g0, t0), (y1, g1, t1) = out[False], out[True]
    assert t0 == [0, 0, 0, 0]
    assert t1 == [1, 1, 1, 0]  # every block but the last prefetches the next
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
