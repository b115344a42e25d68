"""The fused sampler (`fused.sample_rows`: a log-sum-exp pass over vocabulary chunks, then one inverse-CDF draw a row
found chunk first) under Triton's CPU interpreter: log-probs of the drawn tokens equal torch's log_softmax, greedy is
the argmax, chunks with nothing in them (a vocabulary smaller than the chunk count's spans, -inf logits) add no mass,
and a distribution split across chunks is sampled in proportion. tests/test_native_rollout_gpu.py checks the
frequencies at 20,000 rows on the GPU.

Skipped unless `triton` imports AND TRITON_INTERPRET=1 (CI has neither). Run it with
`TRITON_INTERPRET=1 PYTHONPATH=/work/triton_site:. python -m pytest -q tests/test_sampler_interp_on_cpu.py`.
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("triton_interpreter_scalars")]


@pytest.mark.parametrize("T", [0.0, 0.7, 1.0])
def test_logprobs_match_log_softmax_and_greedy_is_argmax(T):
    from polyrl.rollout.native.fused import sample_rows

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3000, generator=g) * 3
    logits[0, 2000:] = float("-inf")  # whole chunks of -inf logits add nothing
    tok, lp = sample_rows(logits, T, seed=7)
    ref = torch.log_softmax(logits / (T or 1.0), -1).gather(1, tok[:, None]).squeeze(1)
    assert (lp - ref).abs().max() < 1e-5
    assert torch.isfinite(lp).all() and tok[0] < 2000
    if T == 0.0:
        assert torch.equal(tok, logits.argmax(-1))


def test_mass_split_across_chunks_is_sampled_in_proportion():
    from polyrl.rollout.native.fused import sample_rows

    R, V = 300, 5000
    logits = torch.full((R, V), -30.0)
    logits[:, [100, 3000, 4900]] = torch.tensor([0.0, 0.0, 0.6931])  # 1 : 1 : 2, in different chunks
    tok, _ = sample_rows(logits, 1.0, seed=3)
    freq = torch.stack([(tok == i).float().mean() for i in (100, 3000, 4900)])
    assert (freq - torch.tensor([0.25, 0.25, 0.5])).abs().max() < 0.1, freq
