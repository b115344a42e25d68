"""benchmarks/seed_step.py (issue 22's whole-step table) on 2 gloo processes with a tiny model: both modes run to the
end and print the seed's table with every metric filled. The numbers themselves need the GPU node."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["colocated", "offpolicy"])
def test_seed_step_prints_the_seed_table(mode, tmp_path):
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
            str(ROOT / "benchmarks" / "seed_step.py"), "--mode", mode, "--shape", "tiny", "--device", "cpu",
            "--seqs", "8", "--samples-per-prompt", "4", "--prompt", "48", "--mean-len", "12", "--max-len", "24",
            "--steps", "2", "--work", str(tmp_path), "--json-out", str(tmp_path / "out.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "| step throughput, whole job (tok/s) |" in done.stdout and "| 20,023 | 20,882 |" in done.stdout
    ours = json.loads((tmp_path / "out.json").read_text())["summary"]
    assert ours["response_length"] > 12 * 0.8 and ours["gen_s"] > 0 and ours["step_tok_s_total"] > 0
    assert ours["gen_tok_s_per_replica"] == pytest.approx(2 * ours["gen_tok_s_per_gpu"])
