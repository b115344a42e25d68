"""verl compatibility and crash safety, through the real `polyrl` command in subprocesses.

- The seed's verl GRPO command line (examples/grpo_verl_seed.sh) runs with `polyrl train`: every key parses; keys
  that need absent hardware/software are refused one at a time with a sentence that names the key and the fix;
  applying the fixes makes it train.
- A run killed with SIGKILL and resumed with resume_mode=auto ends bitwise equal to an uninterrupted run.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from background_run import run_in_background

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def test_seed_verl_command_runs_after_the_refusals_it_explains(tiny_model_dir, synth_data_dir, tmp_path):
    env = _env(TRAIN=synth_data_dir / "train.parquet", VAL=synth_data_dir / "val.parquet", MODEL=tiny_model_dir,
               BATCH=4, MINI_BATCH=2, N=2, PROMPT_LEN=32, RESPONSE_LEN=6, MAX_TOKENS=64, GPUS=1, NODES=1)
    tail = [f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.total_training_steps=1", "trainer.progress_bar=False", "trainer.logger=[console,file]"]
    fixes = {  # refused key -> the value its message says to use instead
        "rollout.name=sglang": "actor_rollout_ref.rollout.name=hf",
        "tensor_model_parallel_size=2": "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "ulysses_sequence_parallel_size=4": "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
        "param_offload": "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    }
    applied, refused = [], []
    for _ in range(len(fixes) + 2):
        p = subprocess.run(["bash", str(ROOT / "examples" / "grpo_verl_seed.sh"), *tail, *applied], env=env,
                           capture_output=True, text=True, timeout=300)
        if p.returncode == 0:
            break
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 2 and last.startswith("polyrl: error:"), p.stderr[-2000:]
        assert "Traceback" not in p.stderr
        key = next((k for k in fixes if k in last), None)
        assert key is not None, f"unexpected refusal: {last}"
        refused.append(key)
        if key == "param_offload":  # the message covers the whole offload group; turn all of it off
            applied += ["actor_rollout_ref.actor.fsdp_config.param_offload=False",
                        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
                        "actor_rollout_ref.ref.fsdp_config.param_offload=False"]
        else:
            applied.append(fixes[key])
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(refused) == sorted(fixes)
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("critic/score/mean") == 1


def _train_cmd(model_dir, data_dir, out, steps):
    return [sys.executable, "-m", "polyrl.train",
            "algorithm.adv_estimator=grpo",
            f"data.train_files={data_dir / 'train.parquet'}", "data.train_batch_size=4",
            "data.max_prompt_length=32", "data.max_response_length=6",
            f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=4",
            "trainer.logger=[file]", f"trainer.run_dir={out / 'run'}", f"trainer.default_local_dir={out / 'ckpt'}",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=1", "trainer.progress_bar=False",
            "trainer.resume_mode=auto"]


STEPS = 8


@pytest.fixture(scope="module")
def clean_run(tiny_model_dir, synth_data_dir, tmp_path_factory):
    """The uninterrupted run both kill cases compare with, started once beside the first case's runs; calling the
    fixture's value waits for it and returns its folder."""
    clean = tmp_path_factory.mktemp("clean")
    yield from run_in_background(_train_cmd(tiny_model_dir, synth_data_dir, clean, STEPS), _env(), clean)


@pytest.mark.parametrize("wait_for_step,kill_after_s", [(1, 0.0), (3, 0.05)])
def test_sigkill_then_resume_is_bitwise_identical(tiny_model_dir, synth_data_dir, tmp_path, clean_run, wait_for_step,
                                                  kill_after_s):
    steps = STEPS
    crashed = tmp_path / "crashed"
    latest = crashed / "ckpt" / "latest_checkpointed_iteration.txt"
    proc = subprocess.Popen(_train_cmd(tiny_model_dir, synth_data_dir, crashed, steps), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and int(latest.read_text() or 0) >= wait_for_step:
            break
        time.sleep(0.005)
    time.sleep(kill_after_s)  # somewhere inside a later step, possibly inside a checkpoint write
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert latest.exists()
    killed_at = int(latest.read_text())
    assert killed_at < steps, "the run finished before it was killed; the test proved nothing"
    subprocess.run(_train_cmd(tiny_model_dir, synth_data_dir, crashed, steps), env=_env(), check=True, timeout=300,
                   capture_output=True)
    a = load_file(str(clean_run() / "ckpt" / f"global_step_{steps}" / "model.safetensors"))
    b = load_file(str(crashed / "ckpt" / f"global_step_{steps}" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), f"{k} differs after resume (killed after step {killed_at})"
