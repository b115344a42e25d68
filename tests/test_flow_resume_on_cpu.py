"""A FlowGRPO run killed with SIGKILL and resumed (trainer.resume_mode=auto) ends bitwise equal to an uninterrupted
run: the same checkpoint code as the LLM trainer (polyrl/trainer/core.py; tests/test_verl_compat_on_cpu.py kills an
LLM run the same way).

The run is this file as a script (`__main__` at the bottom): the tiny quickstart transformer (random init) with
LoRA, a KL term, AdamW with warmup, a checkpoint every step. Each step sleeps a little in its reward so that the kill
lands inside a later step, possibly inside a checkpoint write.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from background_run import run_in_background

STEPS = 6


def _trainer(out: Path, steps: int):
    from polyrl.models.diffusion import tiny
    from polyrl.trainer import flow_quickstart
    from polyrl.trainer.flow_config import FlowConfig
    from polyrl.trainer.flow_grpo import FlowGRPOTrainer

    cfg = FlowConfig()
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    ro.n, ro.pipeline.num_inference_steps = 2, 4
    ro.algo.sde_window_size, ro.algo.sde_window_range = 2, [0, 3]
    ro.val_kwargs.num_inference_steps = 3
    cfg.data.train_batch_size, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu = 4, 2, 2
    actor.optim.lr, actor.optim.lr_warmup_steps, actor.diffusion_loss.clip_ratio = 1e-3, 3, 0.5
    actor.use_kl_loss, actor.kl_loss_coef = True, 0.05
    cfg.actor_rollout_ref.model.lora_rank, cfg.actor_rollout_ref.model.lora_alpha = 4, 8
    t = cfg.trainer
    t.total_training_steps, t.test_freq, t.save_freq, t.resume_mode = steps, 3, 1, "auto"
    t.run_dir, t.default_local_dir, t.logger, t.progress_bar = str(out / "run"), str(out / "ckpt"), ["file"], False
    torch.manual_seed(0)
    policy = flow_quickstart.make_policy(cfg, tiny.build_transformer(seed=0), tiny.CharPromptEncoder(seed=0))
    prompts = [(tiny.prompt_for(d), {"digit": d}) for d in range(10)]

    def reward(images, prompts, metadata):
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
        return images.float().mean(dim=(1, 2, 3))

    return FlowGRPOTrainer(cfg, policy, reward, prompts, prompts[:3])


def _command(out: Path) -> list[str]:
    return [sys.executable, __file__, str(out)]


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path.cwd()), **extra}


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """The uninterrupted run both kill cases compare with, started once beside the first case's runs; calling the
    fixture's value waits for it and returns its folder."""
    clean = tmp_path_factory.mktemp("clean")
    yield from run_in_background(_command(clean), _env(), clean)


@pytest.mark.parametrize("wait_for_step,kill_after_s", [(2, 0.0), (3, 0.03)])
def test_sigkill_then_resume_is_bitwise_identical(tmp_path, clean_run, wait_for_step, kill_after_s):
    crashed = tmp_path / "crashed"
    latest = crashed / "ckpt" / "latest_checkpointed_iteration.txt"
    proc = subprocess.Popen(_command(crashed), env=_env(STEP_SLEEP="0.05"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and int(latest.read_text() or 0) >= wait_for_step:
            break
        time.sleep(0.005)
    time.sleep(kill_after_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = int(latest.read_text())
    assert killed_at < STEPS, "the run finished before it was killed; the test proved nothing"
    done = subprocess.run(_command(crashed), env=_env(), check=True, timeout=300, capture_output=True, text=True)
    assert f"resumed from {crashed / 'ckpt'}" in done.stdout and f"at step {killed_at}" in done.stdout
    a = load_file(str(clean_run() / "ckpt" / f"global_step_{STEPS}" / "model.safetensors"))
    b = load_file(str(crashed / "ckpt" / f"global_step_{STEPS}" / "model.safetensors"))
    base = _trainer(tmp_path / "fresh", STEPS).checkpoint_state()["model"]
    assert a.keys() == b.keys() and all("lora" in k for k in a)
    assert max(float((a[k] - base[k]).abs().max()) for k in a) > 1e-4  # training moved them: equality means much
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume (killed after step {killed_at})"
    rows = [line for line in (crashed / "run" / "metrics.jsonl").read_text().splitlines() if '"critic/rewards' in line]
    assert len(rows) == STEPS  # one row per step: the rows past the checkpoint were dropped and trained again


if __name__ == "__main__":
    _trainer(Path(sys.argv[1]), STEPS).fit()
