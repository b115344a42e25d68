"""`polyrl flow quickstart [KEY=VALUE ...]` and `polyrl flow train KEY=VALUE ...` (called by polyrl/cli.py).

`train` with `actor_rollout_ref.model.path` unset trains the quickstart's tiny digit model with the given keys;
with a path it loads that diffusers pipeline, reads prompts from `data.train_files` / `data.val_files` (one prompt per
line, or parquet with a `prompt` column and optional `ground_truth`) and scores them with `reward.*`.

Several processes: `trainer.n_gpus_per_node=N` makes `train` check the config once and relaunch itself under torchrun
(`torchrun --nproc_per_node=N -m polyrl flow train ...`, which also works typed by hand); each rank then loads the
pipeline onto its own GPU and the trainer shards the transformer (polyrl.distributed.dit_fsdp).
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


def build_flow_reward(r):
    """The image reward (`cfg.reward`): the weighted reward fn the trainer calls (validation, and training when no
    scorer runs), and the async scorer or reward-pool actor that scores training batches elsewhere, or None."""
    from polyrl.rewards import image_rewards
    from polyrl.rewards.async_scorer import build_scorer
    from polyrl.rewards.vlm_judge import judge_spec

    judge = judge_spec(r.reward_model)
    reward_fns = r.reward_fns or ({} if r.custom_reward_function.path or judge else {"ocr": 1.0})
    args = (reward_fns, r.custom_reward_function.path, r.custom_reward_function.name, None, judge)
    return image_rewards.build_reward(*args), build_scorer(r, image_rewards.build_reward, args)


def train(argv: list[str]) -> int:
    from polyrl.config import build_config
    from polyrl.trainer import flow_quickstart
    from polyrl.trainer.flow_config import FlowConfig
    from polyrl.models.diffusion.pipeline import load_pipeline_policy
    from polyrl.trainer.flow_grpo import FlowGRPOTrainer

    cfg = build_config(FlowConfig(), argv)
    from polyrl.trainer.checks import check_flow_supported

    check_flow_supported(cfg)  # before launching and loading: fsdp_config.model_dtype sets model.dtype
    code = _maybe_launch(cfg, argv)
    if code is not None:
        return code
    if cfg.actor_rollout_ref.model.path is None:
        return 0 if flow_quickstart.run(argv) else 1
    if cfg.data.train_files is None:
        raise ConfigError("data.train_files is required with actor_rollout_ref.model.path; pass a prompt file.")
    from polyrl.distributed import DistEnv

    fsdp = cfg.actor_rollout_ref.actor.fsdp_config
    dist = DistEnv.setup(cfg.trainer.device, fsdp_size=fsdp.fsdp_size, cpu_offload=fsdp.cpu_offload)
    device = dist.device if dist.is_distributed else pick_device(cfg.trainer.device)
    p, m = cfg.actor_rollout_ref.rollout.pipeline, cfg.actor_rollout_ref.model
    policy = load_pipeline_policy(m.path, height=p.height, width=p.width, true_cfg_scale=p.true_cfg_scale,
                                  negative_prompt=p.negative_prompt, max_sequence_length=p.max_sequence_length,
                                  guidance_scale=p.guidance_scale, dtype=m.dtype, device=device)  # fmt: skip
    if m.lora_rank > 0:
        policy.add_lora(m.lora_rank, m.lora_alpha, m.target_modules, m.lora_init)
    if m.enable_gradient_checkpointing:
        policy.transformer.enable_gradient_checkpointing()
    train_prompts = load_prompts(cfg.data.train_files)
    val_prompts = load_prompts(cfg.data.val_files) if cfg.data.val_files else train_prompts[: cfg.data.val_batch_size]
    reward_fn, scorer = build_flow_reward(cfg.reward)
    trainer = FlowGRPOTrainer(cfg, policy, reward_fn, train_prompts, val_prompts, async_scorer=scorer, dist=dist)
    try:
        history = trainer.fit()
    except BaseException:
        dist.close()  # no barrier: a failed rank's peers may never reach it
        raise
    finally:
        if scorer is not None:
            scorer.close()
    dist.finish()
    if history["val"] and dist.is_rank0:
        print(f"validation reward: {history['val'][0]:.4f} -> {history['val'][-1]:.4f}; run directory "
              f"{trainer.run_dir}, checkpoint {trainer.final_checkpoint}")
    return 0


def _maybe_launch(cfg, argv: list[str]) -> int | None:
    """The torchrun job's exit status when the config asks for more processes than this one, else None."""
    from polyrl.distributed.launch import under_torchrun
    from polyrl.trainer.job import maybe_launch, processes_wanted
    from polyrl.trainer.flow_grpo import check_batches

    if under_torchrun() or processes_wanted(cfg) == 1:
        return None
    if cfg.trainer.nnodes > 1:
        raise ConfigError(
            f"trainer.nnodes={cfg.trainer.nnodes}: `polyrl flow train` starts processes on one node only; run "
            "`torchrun --nnodes=... --nproc_per_node=... -m polyrl flow train ...` on each node instead."
        )
    if cfg.actor_rollout_ref.model.path is None:  # the quickstart, with its own defaults
        from polyrl.config import build_config
        from polyrl.trainer import flow_quickstart

        quick = build_config(flow_quickstart.default_config(), argv)
        check_batches(quick, processes_wanted(cfg))
        flow_quickstart.build(flow_quickstart.BuildSettings())  # once here: the ranks would all build the same cache
        argv = [*argv, *flow_quickstart.own_run_dir(quick)]
    else:
        check_batches(cfg, processes_wanted(cfg))  # a config error as one sentence here, not once per rank
    return maybe_launch(cfg, ["flow", "train", *argv], module="polyrl")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("quickstart", "train") and ("-h" in rest or "--help" in rest):
        from polyrl.config import overrides_help

        print(overrides_help(f"flow {cmd}", "flow"))
        return 0
    if cmd == "quickstart":
        from polyrl.trainer import flow_quickstart

        flow_quickstart.run(rest)
        return 0
    if cmd == "train":
        return train(rest)
    raise ConfigError(f"Unknown flow command {cmd!r}; use 'polyrl flow quickstart' or 'polyrl flow train KEY=VALUE ...'.")


if __name__ == "__main__":
    raise SystemExit(main())
