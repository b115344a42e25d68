"""`FrozenOffload` (polyrl/utils/offload.py): a frozen module lives in host memory, runs where it is loaded, and
releasing it copies nothing back. On CPU the host copies are plain tensors; the GPU test loads onto CUDA."""

import pytest
import torch
from torch import nn

from polyrl.utils.offload import FrozenOffload


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    m.register_buffer("scale", torch.full((4,), 2.0))
    m.forward = lambda x: nn.Sequential.forward(m, x) * m.scale
    return m


def _check(device: str) -> None:
    m = _encoder()
    x = torch.randn(3, 8)
    want = m(x)
    off = FrozenOffload(m)
    host = [t.data_ptr() for t in off.host]
    assert [t.data_ptr() for t in list(m.parameters()) + list(m.buffers())] == host  # released: on its host copies
    with off.on(device):
        assert all(t.device.type == torch.device(device).type for t in list(m.parameters()) + list(m.buffers()))
        got = m(x.to(device)).cpu()
    torch.testing.assert_close(got, want)
    assert [t.data_ptr() for t in list(m.parameters()) + list(m.buffers())] == host
    assert all(t.device.type == "cpu" for t in m.parameters())


def test_frozen_offload_runs_where_loaded_and_returns_to_its_host_copies():
    _check("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_frozen_offload_on_the_gpu():
    _check("cuda")
    assert all(h.is_pinned() for h in FrozenOffload(_encoder()).host)
