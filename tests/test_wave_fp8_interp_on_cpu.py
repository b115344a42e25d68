"""The one-wave FP8 GEMM (`wave_fp8.py`) under Triton's CPU interpreter against the dequantised product: a program
per SM stand-in (4 here), each with a column block and a leftover chunk, rows 1-200 (BM a power of two, masked),
leftovers none / ragged / one chunk a program. The interpreter has no e4m3 MMA: both sides are upcast to fp16
(exact); tests/test_fp8_rollout_gpu.py runs the e4m3 MMA.

Skipped unless `triton` imports AND TRITON_INTERPRET=1 (CI has neither). Run it with
`TRITON_INTERPRET=1 PYTHONPATH=/work/triton_site:. python -m pytest -q tests/test_wave_fp8_interp_on_cpu.py`.
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("triton_interpreter_scalars")]

SMALL = dict(BN=16, BK=32, num_warps=4, num_stages=1)


@pytest.mark.parametrize("M", [1, 17, 64, 200])
@pytest.mark.parametrize("N", [64, 100, 128])  # 4 programs x 16 columns, then no / ragged / whole leftover chunks
def test_one_wave_matches_the_dequantised_product(M, N):
    from polyrl.rollout.native import wave_fp8
    from polyrl.rollout.native.attention import FP8Rows, quantize_fp8_rows

    K = 96
    g = torch.Generator().manual_seed(M * 1000 + N)
    w8, s = quantize_fp8_rows(torch.randn(N, K, generator=g) * 0.05)
    xq, xs = quantize_fp8_rows(torch.randn(M, K, generator=g))
    assert wave_fp8.plan(N, K, 4, SMALL) == (64, 16)
    y = wave_fp8.one_wave_fp8_matmul(FP8Rows(xq, xs), w8, s, torch.float32, programs=4, config=SMALL)
    ref = (xq.double() * xs.double()[:, None]) @ (w8.double() * s.double()[:, None]).t()
    assert y.shape == (M, N)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_plan_refuses_shapes_one_wave_cannot_hold():
    from polyrl.rollout.native import wave_fp8

    assert wave_fp8.plan(17920, 1536, 132) == (16896, 16)  # the 1.5B gate_up on an H100 / H200
    assert wave_fp8.plan(16000, 1536, 132) is None  # fewer columns than a block a program
    assert wave_fp8.plan(132 * 128 + 132 * 64 + 1, 1536, 132) is None  # a leftover wider than MAX_EXTRA a program
    assert wave_fp8.plan(17920, 1500, 132) is None  # K not in whole steps
    with pytest.raises(ValueError, match="does not fit"):
        from polyrl.rollout.native.attention import FP8Rows, quantize_fp8_rows

        xq, xs = quantize_fp8_rows(torch.randn(3, 96))
        w8, s = quantize_fp8_rows(torch.randn(40, 96))
        wave_fp8.one_wave_fp8_matmul(FP8Rows(xq, xs), w8, s, torch.float32, programs=4, config=SMALL)
