"""`polyrl flow quickstart [KEY=VALUE ...]` and `polyrl flow train KEY=VALUE ...` (called by polyrl/cli.py).

`train` with `actor_rollout_ref.model.path` unset trains the quickstart's tiny digit model with the given keys;
with a path it loads that diffusers pipeline, reads prompts from `data.train_files` / `data.val_files` (one prompt per
line, or parquet with a `prompt` column and optional `ground_truth`) and scores them with `reward.*`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from polyrl.errors import ConfigError, DataError
from polyrl.utils.device import pick_device

USAGE = "usage: polyrl flow {quickstart,train} [--config FILE.yaml] [KEY=VALUE ...]"


def load_prompts(path: str) -> list[tuple[str, dict]]:
    """(prompt, metadata) pairs from a .txt (one per line) or .parquet (`prompt`, optional `ground_truth`) file."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"Prompt file {path!r} does not exist; pass a .txt (one prompt per line) or .parquet file.")
    if p.suffix == ".parquet":
        import pandas as pd

        df = pd.read_parquet(p)
        if "prompt" not in df.columns:
            raise DataError(f"{path!r} has no 'prompt' column (columns: {list(df.columns)}); add one.")
        gts = df["ground_truth"].tolist() if "ground_truth" in df.columns else [None] * len(df)
        out = [(str(q), {} if g is None else {"ground_truth": str(g)}) for q, g in zip(df["prompt"], gts)]
    else:
        out = [(line.strip(), {}) for line in p.read_text().splitlines() if line.strip()]
    if not out:
        raise DataError(f"Prompt file {path!r} holds no prompts.")
    return out


def train(argv: list[str]) -> int:
    from polyrl.config import build_config, save_config, to_dict
    from polyrl.flow import quickstart, rewards
    from polyrl.flow.config import FlowConfig
    from polyrl.flow.pipeline import load_pipeline_policy
    from polyrl.flow.trainer import FlowGRPOTrainer
    from polyrl.utils.tracking import Tracker

    cfg = build_config(FlowConfig(), argv)
    if cfg.actor_rollout_ref.model.path is None:
        return 0 if quickstart.run(argv) else 1
    device = pick_device(cfg.trainer.device)
    p, m = cfg.actor_rollout_ref.rollout.pipeline, cfg.actor_rollout_ref.model
    policy = load_pipeline_policy(m.path, height=p.height, width=p.width, true_cfg_scale=p.true_cfg_scale,
                                  negative_prompt=p.negative_prompt, max_sequence_length=p.max_sequence_length,
                                  dtype=m.dtype, device=device)  # fmt: skip
    if m.lora_rank > 0:
        policy.add_lora(m.lora_rank, m.lora_alpha, m.target_modules, m.lora_init)
    if m.enable_gradient_checkpointing:
        policy.transformer.enable_gradient_checkpointing()
    if cfg.data.train_files is None:
        raise ConfigError("data.train_files is required with actor_rollout_ref.model.path; pass a prompt file.")
    train_prompts = load_prompts(cfg.data.train_files)
    val_prompts = load_prompts(cfg.data.val_files) if cfg.data.val_files else train_prompts[: cfg.data.val_batch_size]
    r = cfg.reward
    reward_fns = r.reward_fns or ({} if r.custom_reward_function.path else {"ocr": 1.0})
    reward_fn = rewards.build_reward(reward_fns, r.custom_reward_function.path, r.custom_reward_function.name)
    run_dir = Path(cfg.trainer.default_local_dir)
    save_config(cfg, run_dir / "config.yaml")
    tracker = Tracker(cfg.trainer.logger, str(run_dir), project_name=cfg.trainer.project_name,
                      experiment_name=cfg.trainer.experiment_name, config=to_dict(cfg))  # fmt: skip
    scorer = None
    if r.async_reward:
        from polyrl.flow.async_reward import AsyncRewardScorer

        scorer = AsyncRewardScorer(rewards.build_reward, (reward_fns, r.custom_reward_function.path,
                                                          r.custom_reward_function.name), r.num_workers)  # fmt: skip
    trainer = FlowGRPOTrainer(cfg, policy, reward_fn, train_prompts, val_prompts, tracker=tracker, async_scorer=scorer)
    try:
        history = trainer.fit()
    finally:
        tracker.close()
        if scorer is not None:
            scorer.close()
    if history["val"]:
        print(f"validation reward: {history['val'][0]:.4f} -> {history['val'][-1]:.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "quickstart":
        from polyrl.flow import quickstart

        quickstart.run(rest)
        return 0
    if cmd == "train":
        return train(rest)
    raise ConfigError(f"Unknown flow command {cmd!r}; use 'polyrl flow quickstart' or 'polyrl flow train KEY=VALUE ...'.")


if __name__ == "__main__":
    raise SystemExit(main())
