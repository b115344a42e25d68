"""The FP8-weight decode GEMM (`w8a16.py`) under Triton's CPU interpreter against the dequantised product: 1-64 rows
(tiles of 16, 32 and 64), ragged and even K, N not a multiple of the column block, with and without bias. fp16/fp32
activations (the interpreter's bf16 `tl.dot` multiplies raw bits; tests/test_fp8_rollout_gpu.py covers bf16 on CUDA).

Skipped unless `triton` imports AND TRITON_INTERPRET=1 (CI has neither). Run it with
`TRITON_INTERPRET=1 PYTHONPATH=/work/triton_site:. python -m pytest -q tests/test_w8a16_interp_on_cpu.py`.
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("triton_interpreter_scalars")]


@pytest.mark.parametrize("M", [1, 5, 16, 17, 33, 64])
@pytest.mark.parametrize("N,K", [(40, 100), (96, 256), (33, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a16_matches_the_dequantised_product(M, N, K, dtype, bias):
    from polyrl.rollout.native.attention import quantize_fp8_rows
    from polyrl.rollout.native.w8a16 import w8a16_matmul

    g = torch.Generator().manual_seed(M * 1000 + N + K)
    w8, s = quantize_fp8_rows(torch.randn(N, K, generator=g) * 0.05)
    x = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    y = w8a16_matmul(x, w8, s, b, dtype, config=dict(BN=16, BK=64, num_warps=4, num_stages=1))
    ref = x.double() @ (w8.double() * s.double()[:, None]).t() + (b.double() if bias else 0)
    assert y.shape == (M, N) and y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert ((y.double() - ref).norm() / ref.norm()).item() < tol


def test_w8a16_refuses_more_rows_than_it_serves():
    from polyrl.rollout.native.w8a16 import MAX_ROWS, w8a16_matmul

    with pytest.raises(ValueError, match="at most"):
        w8a16_matmul(torch.zeros(MAX_ROWS + 1, 64), torch.zeros(16, 64, dtype=torch.float8_e4m3fn), torch.ones(16),
                     None, torch.float32)
    with pytest.raises(ValueError, match="BM=16"):
        w8a16_matmul(torch.zeros(17, 64), torch.zeros(16, 64, dtype=torch.float8_e4m3fn), torch.ones(16),
                     None, torch.float32, config=dict(BM=16))
