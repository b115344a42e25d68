"""Issue 24's resume check, on CPU: `benchmarks/flow_grpo.py --full --no-cfg` under torchrun (2 processes, FSDP2 over
gloo) saves a DCP checkpoint after its timed steps and runs the next step; a new job resumes the checkpoint and runs
that step again. The script's verdict must say the loaded state is the saved one bit for bit and the step is equal."""

import json
import os
import subprocess
from pathlib import Path

from polyrl.distributed.launch import torchrun_command

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--tiny", "--full", "--no-cfg", "--steps", "1", "--prompts", "2", "--micro", "4", "--brightness-term", "0.1"]


def _job(*args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(torchrun_command(2, [str(ROOT / "benchmarks/flow_grpo.py"), *ARGS, *args]), env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_two_process_full_fine_tuning_resumes_its_checkpoint_exactly(tmp_path):
    _job("--save-check", str(tmp_path))
    first = json.loads((tmp_path / "uninterrupted.json").read_text())
    assert first["step"] == 3 and (tmp_path / "global_step_2" / "dcp" / ".metadata").is_file()
    assert first["metrics"]["actor/grad_norm"] > 0  # the brightness term gives real gradients to compare
    assert set(first["saved"]) == {"weights", "exp_avg", "exp_avg_sq", "adam_steps", "lr"}
    assert first["saved"]["adam_steps"] == [4.0]  # 2 steps (warm-up, timed) x 2 optimizer steps each
    out = _job("--resume-check", str(tmp_path))
    verdict = json.loads((tmp_path / "resumed.json").read_text())["verdict"]
    assert "resumed from" in out and verdict["same_step"] and verdict["state_loaded_bitwise"], verdict
    assert verdict["rewards_equal"] and verdict["metrics_max_rel_diff"] < 1e-6, verdict
    assert verdict["after_step_max_rel_diff"] < 1e-9, verdict
    assert first["after"] != first["saved"]  # the step moved the state: equality means something
