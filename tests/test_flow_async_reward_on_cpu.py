"""The async reward worker scores chunks while the caller keeps working, and returns scores in submission order."""

import time

import pytest
import torch

from polyrl.errors import RewardError
from polyrl.rewards import image_rewards
from polyrl.rewards.async_scorer import AsyncRewardScorer

SLOW = """
import time
def score(images, prompts, metadata):
    if prompts[0] == "boom":
        raise RuntimeError("boom")
    time.sleep(0.15)  # a slow reward model / OCR engine
    return images.mean(dim=(1, 2, 3)).tolist()
"""


def test_async_reward_overlaps_generation_and_keeps_order(tmp_path):
    f = tmp_path / "slow_reward.py"
    f.write_text(SLOW)
    scorer = AsyncRewardScorer(image_rewards.build_reward, ({}, str(f), "score"), num_workers=1)
    try:
        chunks = [torch.full((2, 1, 4, 4), float(i)) for i in range(4)]
        scorer.submit(-1, chunks[0], ["w", "w"], [{}, {}])  # warm-up: the worker has imported and built its fn
        scorer.collect(2)
        t0 = time.perf_counter()
        for i, images in enumerate(chunks):
            time.sleep(0.15)  # "generating" the chunk
            scorer.submit(2 * i, images, ["p", "p"], [{}, {}])
        scores = scorer.collect(8)
        overlapped = time.perf_counter() - t0
        torch.testing.assert_close(scores, torch.tensor([0.0, 0, 1, 1, 2, 2, 3, 3]))
        # serial would be 4 x (0.15 gen + 0.15 score) = 1.2 s; overlapped is about 0.75 s
        assert overlapped < 1.05, overlapped
        # a failing reward fn surfaces as a RewardError naming the cause, not a hang
        scorer.submit(0, torch.zeros(1, 1, 2, 2), ["boom"], [{}])
        with pytest.raises(RewardError, match="boom"):
            scorer.collect(1)
    finally:
        scorer.close()


def test_reward_pool_without_a_ray_cluster_is_refused(monkeypatch):
    ray = pytest.importorskip("ray")
    from polyrl.errors import ConfigError
    from polyrl.rewards.async_scorer import RayRewardScorer

    if ray.is_initialized():
        pytest.skip("a Ray cluster is already up in this process (another test file left it running)")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # no cluster to join: a local Ray would hand out the trainer's GPUs
    with pytest.raises(ConfigError, match="needs a Ray cluster that knows them"):
        RayRewardScorer(image_rewards.build_reward, ({}, None, "score"), num_gpus=1)
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray cluster (2 CPUs, no GPUs) for the module's Ray tests: each start costs seconds."""
    ray = pytest.importorskip("ray")
    from polyrl.distributed.ray_cluster import init_ray

    started_here = not ray.is_initialized()
    init_ray(num_cpus=2)
    yield ray
    if started_here:
        ray.shutdown()


def test_ray_reward_scorer_keeps_order_and_reports_errors(tmp_path, local_ray):
    """The reward resource pool's scorer (a Ray actor; on CPU here, num_gpus=0) behaves like the process pool."""
    from polyrl.rewards.async_scorer import RayRewardScorer

    f = tmp_path / "slow_reward.py"
    f.write_text(SLOW)
    scorer = RayRewardScorer(image_rewards.build_reward, ({}, str(f), "score"), num_gpus=0)
    try:
        for i in (1, 0, 2):  # submitted out of order
            scorer.submit(2 * i, torch.full((2, 1, 4, 4), float(i)), ["p", "p"], [{}, {}])
        torch.testing.assert_close(scorer.collect(6), torch.tensor([0.0, 0, 1, 1, 2, 2]))
        scorer.submit(0, torch.zeros(1, 1, 2, 2), ["boom"], [{}])
        with pytest.raises(RewardError, match="boom"):
            scorer.collect(1)
    finally:
        scorer.close()


def test_reward_pool_without_gpus_in_the_ray_cluster_is_refused(local_ray):
    from polyrl.errors import ConfigError
    from polyrl.rewards.async_scorer import RayRewardScorer

    with pytest.raises(ConfigError, match="n_gpus_per_node asks the Ray reward actor for 1 GPU"):
        RayRewardScorer(image_rewards.build_reward, ({}, None, "score"), num_gpus=1)


PID = """
import os
import time
def score(images, prompts, metadata):
    time.sleep(0.3)
    return [float(os.getpid())] * len(prompts)
"""


def test_a_chunk_is_split_among_the_workers_and_keeps_its_order(tmp_path):
    f = tmp_path / "pid_reward.py"
    f.write_text(PID)
    scorer = AsyncRewardScorer(image_rewards.build_reward, ({}, str(f), "score"), num_workers=2)
    try:
        seen = set()
        for _ in range(20):  # until both spawned workers have imported and built their fn
            scorer.submit(0, torch.zeros(4, 1, 2, 2), ["p"] * 4, [{}] * 4)
            seen |= set(scorer.collect(4).tolist())
            if len(seen) == 2:
                break
        scorer.submit(0, torch.zeros(4, 1, 2, 2), ["p"] * 4, [{}] * 4)
        scores = scorer.collect(4).tolist()
        assert scores[0] == scores[1] and scores[2] == scores[3]  # two pieces of 2, in submission order
        assert scores[0] != scores[2]  # scored by the two workers at once
    finally:
        scorer.close()


THREADS = """
import os
def score(images, prompts, metadata):
    return [float(os.environ["POLYRL_REWARD_THREADS"])] * len(prompts)
"""


def test_reward_workers_split_the_cores_of_the_host_among_them(tmp_path, monkeypatch):
    """Each worker's engine gets cores // (workers x processes on the host); rapidocr's onnxruntime reads it."""
    from polyrl.utils.device import cpu_share

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpu_share(8) == 2 and cpu_share() == 16 and cpu_share(100) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    f = tmp_path / "threads_reward.py"
    f.write_text(THREADS)
    scorer = AsyncRewardScorer(image_rewards.build_reward, ({}, str(f), "score"), num_workers=4)
    try:
        scorer.submit(0, torch.zeros(2, 1, 2, 2), ["p"] * 2, [{}] * 2)
        assert scorer.collect(2).tolist() == [16.0, 16.0]  # 64 cores / 4 workers (the parent's affinity)
    finally:
        scorer.close()
    monkeypatch.setenv("POLYRL_REWARD_THREADS", "3")
    assert image_rewards.OCRReward().engine.cfg.EngineConfig.onnxruntime.intra_op_num_threads == 3
