"""The split-K FP8-weight decode GEMM (`splitk_fp8.py`) under Triton's CPU interpreter against the dequantised
product: 1-200 rows of e4m3 activations (`FP8Rows`, past 64 in row blocks), K split 1-9 ways (even and ragged), N not
a multiple of the column block, with and without bias; and the in-launch reduction leaves its counters at zero, so a
second call (a graph replay) gives the same bits. The interpreter's bf16 `tl.dot` multiplies raw bits, and it has no
e4m3 MMA: both sides are upcast to fp16 here (exact); tests/test_fp8_rollout_gpu.py runs the e4m3 MMA.

Skipped unless `triton` imports AND TRITON_INTERPRET=1 (CI has neither). Run it with
`TRITON_INTERPRET=1 PYTHONPATH=/work/triton_site:. python -m pytest -q tests/test_splitk_fp8_interp_on_cpu.py`.
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("triton_interpreter_scalars")]

SMALL = dict(BN=16, BK=32, num_warps=4, num_stages=1, programs_per_sm=4, min_k_steps=1)


def _case(M, N, K, seed):
    from polyrl.rollout.native.attention import quantize_fp8_rows

    g = torch.Generator().manual_seed(seed)
    w8, s = quantize_fp8_rows(torch.randn(N, K, generator=g) * 0.05)
    return w8, s, torch.randn(M, K, generator=g), torch.randn(N, generator=g)


@pytest.mark.parametrize("M", [1, 5, 16, 17, 64, 100, 200])
@pytest.mark.parametrize("N,K", [(40, 100), (96, 256), (33, 288)])
@pytest.mark.parametrize("bias", [False, True])
def test_splitk_matches_the_dequantised_product(M, N, K, bias):
    from polyrl.rollout.native import splitk_fp8
    from polyrl.rollout.native.attention import FP8Rows, quantize_fp8_rows
    from polyrl.rollout.native.counters import arrival_counters

    w8, s, x, b = _case(M, N, K, M * 1000 + N + K)
    dtype = torch.float32
    b = b if bias else None
    bm = min(splitk_fp8.ROW_BLOCK, max(16, triton.next_power_of_2(M)))
    tiles, split, _, m_blocks = splitk_fp8.plan(M, N, K, SMALL, num_sms=8, bm=bm)
    assert split > 1 or K <= 32 or m_blocks > 1  # the reduction (or several row blocks) is what this tests
    xq, xs = quantize_fp8_rows(x)
    arg, x_ref = FP8Rows(xq, xs), xq.double() * xs.double()[:, None]
    y = splitk_fp8.splitk_fp8_matmul(arg, w8, s, b, dtype, config=SMALL)
    ref = x_ref @ (w8.double() * s.double()[:, None]).t() + (b.double() if bias else 0)
    assert y.shape == (M, N) and y.dtype == dtype
    tol = 1e-5
    assert ((y.double() - ref).norm() / ref.norm()).item() < tol
    n = tiles * m_blocks
    assert arrival_counters(y.device, n)[:n].eq(0).all()  # reset by each output tile's last program
    assert torch.equal(splitk_fp8.splitk_fp8_matmul(arg, w8, s, b, dtype, config=SMALL), y)


@pytest.mark.parametrize("M,N,K,split", [(5, 40, 128, 4), (100, 96, 256, 4), (200, 33, 288, 3), (17, 33, 100, 1)])
def test_splitk_partials_sum_to_the_product_and_add_rmsnorm_sums_them(M, N, K, split):
    """`partials=True`: [split, M, N] scaled partial products (no in-launch reduction) that sum to the dequantised
    product, and `fused.add_rmsnorm` given them equals add_rmsnorm of their sum."""
    from polyrl.rollout.native import fused, splitk_fp8
    from polyrl.rollout.native.attention import FP8Rows, quantize_fp8_rows

    w8, s, x, _ = _case(M, N, K, 7 * M + N)
    xq, xs = quantize_fp8_rows(x)
    parts = splitk_fp8.splitk_fp8_matmul(FP8Rows(xq, xs), w8, s, None, torch.float32, config={**SMALL, "split": split},
                                         partials=True)
    ref = (xq.double() * xs.double()[:, None]) @ (w8.double() * s.double()[:, None]).t()
    assert parts.shape == (split, M, N)
    assert ((parts.double().sum(0) - ref).norm() / ref.norm()).item() < 1e-5
    res, w = torch.randn(M, N), torch.rand(N) + 0.5
    got = fused.add_rmsnorm(parts, res, w, 1e-6)
    want = fused.add_rmsnorm(parts.sum(0), res, w, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="no bias"):
        splitk_fp8.splitk_fp8_matmul(FP8Rows(xq, xs), w8, s, torch.zeros(N), torch.float32, partials=True)


def test_plan_covers_the_gpu_with_whole_k_steps():
    from polyrl.rollout.native.splitk_fp8 import CONFIG, plan

    # the 1.5B down projection (N 1536, K 8960) on 132 SMs: 24 column blocks, K split so ~264 programs run
    tiles, split, k_per, _ = plan(64, 1536, 8960, CONFIG, 132)
    assert tiles == 24 and split * tiles >= 132 and k_per % CONFIG["BK"] == 0 and split * k_per >= 8960
    assert (split - 1) * k_per < 8960  # no empty split
    # gate_up (N 17920) already has 280 column blocks: no split
    assert plan(64, 17920, 1536, CONFIG, 132)[1] == 1
    # 256 rows: 4 row blocks of 64, the split shrinks so the program count stays about the same
    t4, s4, _, m4 = plan(256, 1536, 8960, CONFIG, 132)
    assert m4 == 4 and t4 * s4 * m4 <= 2 * tiles * split


def test_splitk_refuses_more_rows_than_it_serves():
    from polyrl.rollout.native.splitk_fp8 import MAX_ROWS, splitk_fp8_matmul

    from polyrl.rollout.native.attention import FP8Rows

    w = torch.zeros(16, 64, dtype=torch.float8_e4m3fn)

    def rows(m):
        return FP8Rows(torch.zeros(m, 64, dtype=torch.float8_e4m3fn), torch.ones(m))

    with pytest.raises(ValueError, match="at most"):
        splitk_fp8_matmul(rows(MAX_ROWS + 1), w, torch.ones(16), None, torch.float32)
    with pytest.raises(ValueError, match="BM=24"):
        splitk_fp8_matmul(rows(17), w, torch.ones(16), None, torch.float32, config=dict(BM=24))


def test_the_kernel_serves_every_row_count_fp8_linear_routes_to_it():
    from polyrl.rollout.native.fp8_linear import SPLITK_WIDE
    from polyrl.rollout.native.splitk_fp8 import MAX_ROWS

    assert max(SPLITK_WIDE.values()) <= MAX_ROWS
