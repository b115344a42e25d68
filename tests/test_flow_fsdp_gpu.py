"""Full fine-tuning with fp32 weights and bf16 compute (`fsdp_config.mixed_precision.param_dtype=bf16`, verl's recipe,
issue 24) on GPUs: FSDP2 over 2 GPUs keeps sharded fp32 weights and AdamW state and every linear computes in bf16
(weights and inputs); one process does the same through fp32 masters. Both train the same steps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl.distributed.launch import torchrun_command

pytestmark = pytest.mark.gpu
JOB = str(Path(__file__).with_name("flow_mixed_precision_job.py"))


def _run(cmd: list[str], out: Path) -> dict:
    # the repository first, then whatever the caller's path holds (the GPU machine's wheels, e.g. diffusers)
    path = [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_full_fine_tuning_keeps_fp32_state_and_computes_in_bf16(tmp_path):
    two = _run(torchrun_command(2, [JOB, str(tmp_path / "two.json")]), tmp_path / "two.json")
    one = _run([sys.executable, JOB, str(tmp_path / "one.json")], tmp_path / "one.json")
    assert two["sharded"] and not two["masters"]
    assert one["masters"] and not one["sharded"]
    for r in (one, two):
        assert r["optimizer_param_dtypes"] == ["torch.float32"] and r["optimizer_state_dtypes"] == ["torch.float32"]
        assert r["linear_weight_and_input_dtypes"] == [["torch.bfloat16", "torch.bfloat16"]], r
        assert r["moved"] > 1e-4
    for a, b in zip(one["rows"], two["rows"]):  # bf16 compute both ways, summed in different orders
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=0.05, abs=1e-3), (key, a[key], b[key])
