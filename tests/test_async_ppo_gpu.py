"""The one-step off-policy pipeline on 2 GPUs (run on the GPU machine): batches over gloo, weights over NCCL."""

import pytest
import torch

from test_async_ppo_on_cpu import _args, _job, _steps, _wait


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (1 trainer, 1 rollout)")
def test_two_gpu_pipeline_streams_weights_over_nccl(tiny_model_dir, synth_data_dir, tmp_path):
    """The native engine on its own GPU, weights streamed in 1 MiB buckets. At age 0 every batch is fresh, so the
    trainer's forward (pi_old from the current weights) is compared with the engine's log-probs at every step: the
    streamed weights are the trainer's up to bf16 rounding. (At age 1, the default, a stale batch takes pi_old from the
    engine and no gap is measured; the CPU tests cover the staleness bookkeeping.)"""
    argv = _args(tiny_model_dir, synth_data_dir, tmp_path, 4, "actor_rollout_ref.hybrid_engine=False",
                 "trainer.device=cuda", "actor_rollout_ref.rollout.name=native", "async_training.weight_bucket_mb=1",
                 "async_training.max_trajectory_age_steps=0")
    argv = [a for a in argv if a != "trainer.device=cpu"]
    codes, log = _wait(_job(argv))
    assert codes == [0, 0], log[-4000:]
    rows = _steps(tmp_path)
    assert [r["async/weight_version/max"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    for r in rows:
        assert r["training/rollout_probs_diff_mean"] < 5e-3, r["training/rollout_probs_diff_mean"]
    assert all(r["timing_s/rollout_update_weights"] >= 0 for r in rows[1:])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs (2 trainer, 2 rollout)")
@pytest.mark.parametrize("tp", [1, 2])
def test_two_trainers_and_two_rollout_gpus_stream_weights_over_nccl(synth_data_dir, tmp_path, tp):
    """2 trainer GPUs (FSDP2) + 2 rollout GPUs (2 replicas, or one TP-2 replica receiving only its slices) at age 0:
    the engine's log-probs are the trainer's forward up to bf16 rounding, step after step."""
    from polyrl.models.tiny import build_tiny_model
    from test_offpolicy_pool_on_cpu import _pool_args, _pool_job

    model_dir = build_tiny_model(tmp_path / "model", hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                                 max_position_embeddings=128)
    argv = _pool_args(model_dir, synth_data_dir, tmp_path / "run", 3, 2, 2, "trainer.device=cuda",
                      f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
                      "async_training.max_trajectory_age_steps=0", "async_training.weight_bucket_mb=1")
    argv = [a for a in argv if a != "trainer.device=cpu"]
    codes, log = _wait(_pool_job(argv, 4))
    assert codes == [0, 0, 0, 0], log[-4000:]
    rows = _steps(tmp_path / "run")
    assert [r["async/weight_version/max"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["training/rollout_probs_diff_mean"] < 5e-3, r["training/rollout_probs_diff_mean"]
        assert r["actor/grad_norm"] > 0
