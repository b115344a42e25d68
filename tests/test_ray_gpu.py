"""Ray on a GPU host (issue 8): the multi-node recipe with real GPUs, and a reward worker holding its own GPU.

One machine stands in for two nodes: `launch_on_ray(..., strategy="SPREAD")` lets both bundles (half the GPUs each,
at most 2) sit on it, so each bundle's torchrun agent runs its ranks on its own GPUs (Ray sets CUDA_VISIBLE_DEVICES
per bundle) and the ranks rendezvous through bundle 0's node as they would across hosts. Needs Ray (carried as a
wheel to the GPU machine) and 2 or more GPUs.
"""

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_gpus():
    from polyrl.distributed.ray_cluster import init_ray

    init_ray(num_cpus=8, num_gpus=torch.cuda.device_count())
    yield ray
    ray.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_node_recipe_on_gpus(ray_gpus, tiny_model_dir, synth_data_dir, tmp_path):
    from polyrl.config import build_config
    from polyrl.distributed.launch import launch_on_ray
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.job import launch_job
    from test_distributed_on_cpu import _args, _steps

    per_node = min(2, torch.cuda.device_count() // 2)
    argv = [a for a in _args(tiny_model_dir, synth_data_dir, tmp_path, 2, "trainer.nnodes=2",
                             f"trainer.n_gpus_per_node={per_node}") if a != "trainer.device=cpu"]  # fmt: skip
    argv += ["trainer.device=cuda", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "trainer.save_freq=2"]  # fmt: skip
    repo = str(Path(__file__).resolve().parent.parent)  # the agents' children import polyrl (and carried wheels)
    os.environ["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])])
    assert launch_on_ray(launch_job(build_config(PPOConfig(), argv)), argv, strategy="SPREAD") == 0
    shards = list((tmp_path / "ckpt" / "global_step_2" / "dcp").glob("*.distcp"))
    assert len(shards) == 2 * per_node  # every rank of both "nodes" wrote its shard
    steps = _steps(tmp_path)
    assert [r["step"] for r in steps] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["actor/pg_loss"])) for r in steps)


def test_reward_worker_on_its_own_gpu(ray_gpus):
    from polyrl.rewards.remote import RemoteReward
    from polyrl.rewards.config import CustomRewardConfig, OverlongBufferConfig

    def gpu_of_worker():
        return ray.get_gpu_ids(), torch.cuda.is_available(), os.environ.get("CUDA_VISIBLE_DEVICES")

    remote = RemoteReward(CustomRewardConfig(), OverlongBufferConfig(), 8, num_gpus=1)
    ids, available, visible = ray.get(ray.remote(num_gpus=1)(gpu_of_worker).remote())
    assert available and len(ids) == 1 and visible == str(ids[0])
    samples = [("polyrl/reverse", "cba", "cba", {}), ("polyrl/reverse", "abc", "cba", {})]
    scores, _ = remote.score(samples, response_lengths=[3, 3])
    assert scores[0] > scores[1]  # the exact answer scores above the wrong one, scored on the GPU worker
    remote.close()
