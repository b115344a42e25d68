"""The one-step off-policy pipeline on 2 GPUs (run on the GPU machine): batches over gloo, weights over NCCL."""

import pytest
import torch

from test_async_ppo_on_cpu import _args, _job, _steps, _wait


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (1 trainer, 1 rollout)")
def test_two_gpu_pipeline_streams_weights_over_nccl(tiny_model_dir, synth_data_dir, tmp_path):
    """The native engine on its own GPU, weights streamed in 1 MiB buckets."""
    argv = _args(tiny_model_dir, synth_data_dir, tmp_path, 4, "actor_rollout_ref.hybrid_engine=False",
                 "trainer.device=cuda", "actor_rollout_ref.rollout.name=native", "async_training.weight_bucket_mb=1")
    argv = [a for a in argv if a != "trainer.device=cpu"]
    codes, log = _wait(_job(argv))
    assert codes == [0, 0], log[-4000:]
    rows = _steps(tmp_path)
    assert [r["async/staleness/max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    for r in rows[1:]:  # behaviour log-probs from the generating weights: only the bf16 engine's rounding apart
        assert r["training/rollout_probs_diff_mean"] < 5e-3, r["training/rollout_probs_diff_mean"]
        assert r["timing_s/rollout_update_weights"] >= 0
