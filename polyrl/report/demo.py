"""A synthetic run directory with every metric the report plots, written through the real `Tracker`.

Used by the tests and by `scripts/check_report_in_browser.py` to look at the page without training anything.
The curves are made up (seeded noise around plausible GRPO trends); nothing here is a measurement.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import yaml

from polyrl.utils.tracking import Tracker


def write_synthetic_run(run_dir: str, num_steps: int = 60, seed: int = 0, crash: bool = True) -> str:
    """Writes metrics.jsonl, config.yaml, env.json and samples/ under `run_dir`; returns `run_dir`.

    With `crash`, one metric is NaN at one step and the file ends in a half-written line, as after a crash.
    """
    rng = np.random.default_rng(seed)
    config = {
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "data": {"train_batch_size": 64, "max_prompt_length": 512, "max_response_length": 1024},
        "actor_rollout_ref": {
            "model": {"path": "/models/Qwen2.5-1.5B-Instruct"},
            "actor": {"optim": {"lr": 1e-6}, "ppo_mini_batch_size": 16, "use_kl_loss": True, "kl_loss_coef": 0.001},
            "rollout": {"name": "native", "n": 8, "temperature": 1.0},
        },
        "trainer": {"total_training_steps": num_steps, "n_gpus_per_node": 8, "nnodes": 1, "logger": ["file"]},
    }
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    env = {
        "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "num_gpus": 8, "world_size": 8,
        "torch": "2.13.0", "python": "3.11", "peak_flops": 989e12, "measured_gemm_flops": 798e12,
        "model_num_params": 1_543_714_304,
    }  # fmt: skip
    with open(os.path.join(run_dir, "env.json"), "w") as f:
        json.dump(env, f)
    tracker = Tracker(["file"], run_dir, project_name="demo", experiment_name="synthetic", config=config)
    for step in range(1, num_steps + 1):
        t = step / num_steps
        score = 0.15 + 0.6 / (1 + math.exp(-10 * (t - 0.4))) + rng.normal(0, 0.04)
        length = 220 + 260 * t + rng.normal(0, 15)
        gen, upd = 9.0 + 4 * t + rng.normal(0, 0.4), 5.5 + rng.normal(0, 0.2)
        stages = {"gen": gen, "reward": 0.6, "old_log_prob": 1.8, "ref": 1.7, "adv": 0.02, "update_actor": upd,
                  "update_weights": 0.35}  # fmt: skip
        if step % 10 == 0:
            stages["testing"] = 4.0
        total = sum(stages.values()) + 0.3
        tokens = 64 * 8 * (380 + length)
        metrics = {
            "critic/score/mean": score,
            "critic/score/max": 1.0,
            "critic/score/min": max(0.0, score - 0.5),
            "critic/rewards/zero_std_ratio": 0.55 - 0.35 * math.sin(math.pi * t) ** 2 + rng.normal(0, 0.03),
            "response_length/mean": length,
            "response_length/max": 1024.0 if t > 0.5 else length * 2,
            "response_length/min": length * 0.3,
            "response_length/clip_ratio": max(0.0, 0.08 * (t - 0.5)),
            "actor/ppo_kl": abs(rng.normal(0.002, 0.001)),
            "actor/kl_loss": 0.02 * t + abs(rng.normal(0, 0.002)),
            "actor/entropy": 0.9 - 0.4 * t + rng.normal(0, 0.02),
            "actor/pg_clipfrac": 0.004 + abs(rng.normal(0, 0.002)),
            "actor/pg_loss": rng.normal(0, 0.05),
            "perf/throughput": tokens / (total * 8),
            "perf/mfu/actor": 0.31 + rng.normal(0, 0.01),
            **{f"timing_s/{k}": v for k, v in stages.items()},
            "timing_s/step": total,
        }
        if step % 10 == 0 or step == 1:
            metrics["val-core/gsm8k/acc/mean@1"] = 0.2 + 0.5 * t + rng.normal(0, 0.01)
            metrics["val-core/math/acc/mean@1"] = 0.1 + 0.3 * t + rng.normal(0, 0.01)
        if crash and step == num_steps // 2:
            metrics["actor/pg_loss"] = float("nan")
        tracker.log(metrics, step)
        if step in (1, num_steps // 2, num_steps):
            tracker.log_images("samples", _sample_images(rng, step / num_steps), step)
    tracker.close()
    if crash:
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            f.write('{"step": %d, "critic/score/me' % (num_steps + 1))
    return run_dir


def _sample_images(rng: np.random.Generator, t: float) -> list[np.ndarray]:
    """Eight 64x64 'digits' that get sharper as t grows (blurred noise -> a clean ring)."""
    yy, xx = np.mgrid[0:64, 0:64]
    ring = np.exp(-((np.hypot(yy - 32, xx - 32) - 18) ** 2) / 20)
    images = []
    for i in range(8):
        noise = rng.random((64, 64))
        img = t * ring + (1 - t) * noise
        rgb = np.stack([img * (0.4 + 0.07 * i), img * 0.7, img], axis=-1)
        images.append((np.clip(rgb, 0, 1) * 255).astype(np.uint8))
    return images
