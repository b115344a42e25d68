"""FSDP2 CPU offload on 2 GPUs (`param_offload` / `optimizer_offload`): the same first update as without offload.

With offload the shards, their gradients and the AdamW state live on the CPU, so the gradient norm, the weight sync
into each rank's rollout engine and the checkpoint gathers run over CPU tensors: the process group then carries gloo
beside nccl (`DistEnv.setup(cpu_offload=True)`). Step 1 samples from identical weights in both runs, so its loss and
gradient norm must agree; the optimizer step itself runs on the CPU in one run and on the GPU in the other.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent


def _run(tmp_path: Path, name: str, model_dir, data_dir, *extra) -> list[dict]:
    from polyrl.distributed.launch import torchrun_command
    from test_distributed_on_cpu import _args

    out = tmp_path / name
    argv = [a for a in _args(model_dir, data_dir, out, 2) if a != "trainer.device=cpu"]
    argv += ["trainer.device=cuda", "trainer.save_freq=2", *extra]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "CUDA_VISIBLE_DEVICES": "0,1"}
    job = subprocess.run(torchrun_command(2, ["-m", "polyrl.train", *argv]), env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "actor/pg_loss" in r]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cpu_offload_gives_the_same_first_update(tmp_path, tiny_model_dir, synth_data_dir):
    plain = _run(tmp_path, "plain", tiny_model_dir, synth_data_dir)
    offloaded = _run(tmp_path, "offload", tiny_model_dir, synth_data_dir,
                     "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                     "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
                     "actor_rollout_ref.ref.fsdp_config.param_offload=True")  # fmt: skip
    assert [r["step"] for r in offloaded] == [1, 2]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
        assert offloaded[0][key] == pytest.approx(plain[0][key], rel=1e-3, abs=1e-5), key
    assert all(torch.isfinite(torch.tensor(r["actor/grad_norm"])) for r in offloaded)
    assert (tmp_path / "offload" / "ckpt" / "global_step_2" / "dcp" / ".metadata").is_file()
