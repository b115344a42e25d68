"""The trainer core both loops share (LLM RL in ppo.py, FlowGRPO in flow_grpo.py): the fit cadence, the run
directory and its loggers, and checkpoints (one protocol, one on-disk format).

A loop subclasses `TrainerCore`, sets `cfg` (with a `trainer` section that is a `LoopConfig`), `dist`, `timer`,
`profiler`, `global_step` and `total_steps`, calls `open_run()` and `open_tracker()` in its constructor, and provides:
- `step() -> metrics` (its stages, top to bottom) and `validate() -> metrics` (empty when it has no held-out data);
- `checkpoint_state() -> {name: tensor dict | object}` and `load_checkpoint_state(state)`: the weights and optimizer
  state of a single process; with several processes `sharded_modules() -> {name: (model, optimizer)}` (the policy's
  under `model`) go through DCP instead;
- `extra_state() -> dict` / `load_extra_state(extra)`: step counters, schedulers, RNG streams (plain objects);
- optionally `export_writers()` (the final checkpoint's exports, e.g. the HF model; `exports_every_save()` for every
  checkpoint) and `after_fit()`.

Cadence, one rule each (verl's keys):
- validate: before training when `trainer.val_before_train` (a fresh run only), every `trainer.test_freq` steps, and
  after the last step whenever there is held-out data; `trainer.val_only` validates once and stops;
- save: every `trainer.save_freq` steps, and always after the last step (the trained model is the product), with the
  exports;
- resume: `trainer.resume_mode` = auto (the latest complete checkpoint under `trainer.default_local_dir`), disable,
  or resume_path (`trainer.resume_from_path`).

On disk (polyrl.utils.checkpoint's atomic layout): `default_local_dir/global_step_N/` holding `extra.pt` plus, in one
process, `model.safetensors` / `optimizer.pt` (and whatever else `checkpoint_state` names), or, with several, `dcp/`
shards (polyrl.distributed.checkpoint) that load at any process count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from polyrl.errors import ConfigError
from polyrl.trainer import run_dirs
from polyrl.utils.checkpoint import CheckpointManager
from polyrl.utils.console import bar_lifted, progress_bar

RESUME_MODES = ("auto", "disable", "resume_path")


@dataclass
class LoopConfig:
    """The `trainer.*` keys every loop reads: cadence, run directory, checkpoints, processes."""

    total_training_steps: int | None = None
    """RL steps (LLM: overrides total_epochs when set)."""
    project_name: str = "polyrl"
    """Project name (trackers, default directories)."""
    experiment_name: str = "run"
    """Experiment name (trackers, default directories)."""
    logger: list[str] = field(default_factory=lambda: ["console", "file"])
    """Tracking backends: console, file (metrics.jsonl), tensorboard, wandb."""
    test_freq: int = -1
    """Validate every N steps (<= 0: only before training and after the last step)."""
    val_before_train: bool = True
    """Validate before the first step of a fresh run."""
    val_only: bool = False
    """Validate once and stop."""
    save_freq: int = -1
    """Checkpoint every N steps (<= 0: only after the last step, which always saves)."""
    resume_mode: str = "auto"
    """auto (latest checkpoint in default_local_dir), disable, or resume_path."""
    resume_from_path: str | None = None
    """Checkpoint folder (global_step_N) to resume from when resume_mode=resume_path."""
    default_local_dir: str | None = None
    """Checkpoint folder; default checkpoints/{project_name}/{experiment_name}."""
    max_actor_ckpt_to_keep: int | None = None
    """Keep only the newest N checkpoints (None: all)."""
    run_dir: str | None = None
    """Where metrics.jsonl, config.yaml and the report go; default a new runs/{project_name}/{experiment_name}/<time>
    per run (a resumed run goes on in its own)."""
    device: str = "auto"
    """auto (cuda if available), cpu or cuda."""
    n_gpus_per_node: int = 1
    """Processes (GPUs) per node; > 1 relaunches the command under torchrun."""
    nnodes: int = 1
    """Nodes."""
    progress_bar: bool = True
    """Draw a progress bar over the steps (on a terminal only)."""


def check_resume(t: LoopConfig) -> None:
    """trainer.resume_mode and the path it needs (the LLM CLI checks it before launching; every loop's open_run)."""
    if t.resume_mode not in RESUME_MODES:
        raise ConfigError(f"trainer.resume_mode={t.resume_mode!r}; use auto, disable or resume_path.")
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N folder).")


class TrainerCore:
    """The shared loop: `fit()` runs steps with the cadence above; `save_checkpoint()` / `resume()` the protocol."""

    progress_metric: tuple[str, str] = ("score", "critic/score/mean")
    """(label, metric) the progress bar shows after each step."""
    bar_label = "polyrl train"

    # ------------------------------------------------------------------------------------------------ the run
    def open_run(self) -> None:
        """`self.ckpt`, `self.resume_from` and `self.run_dir` (the same on every rank); cfg.trainer.run_dir is set."""
        t = self.cfg.trainer
        check_resume(t)
        if t.default_local_dir is None:
            t.default_local_dir = f"checkpoints/{t.project_name}/{t.experiment_name}"
        self.ckpt = CheckpointManager(t.default_local_dir, max_to_keep=t.max_actor_ckpt_to_keep)
        self.resume_from = self._resume_path()
        resumed = run_dirs.checkpoint_run(self.resume_from) if self.resume_from is not None else None
        run = run_dirs.chosen_run_dir(t.run_dir, resumed)  # the same answer on every rank: it only reads files
        if self.dist.is_rank0:
            if run is None:
                run = run_dirs.fresh_run_dir(Path("runs") / t.project_name / t.experiment_name)
            run.mkdir(parents=True, exist_ok=True)
            if resumed is not None and (dropped := run_dirs.drop_rows_after(run, resumed[1])):
                print(f"polyrl: dropped {dropped} metrics rows past step {resumed[1]} from {run / run_dirs.METRICS} "
                      "(this run trains those steps again)", flush=True)
        self.run_dir = Path(self.dist.broadcast_object(str(run) if run is not None else None))
        t.run_dir = str(self.run_dir)

    def open_tracker(self):
        """config.yaml in the run directory and the configured loggers (rank 0 alone writes)."""
        from polyrl.config import save_config, to_dict
        from polyrl.utils.tracking import Tracker

        t = self.cfg.trainer
        if self.dist.is_rank0:
            save_config(self.cfg, self.run_dir / "config.yaml")
        return Tracker(t.logger if self.dist.is_rank0 else [], str(self.run_dir), project_name=t.project_name,
                       experiment_name=t.experiment_name, config=to_dict(self.cfg))

    def _resume_path(self) -> Path | None:
        t = self.cfg.trainer
        if t.resume_mode == "resume_path":
            path = Path(t.resume_from_path)
            if not path.is_dir():
                raise ConfigError(f"Checkpoint folder '{t.resume_from_path}' does not exist; check "
                                  "trainer.resume_from_path.")
            return path
        step = self.ckpt.latest_step() if t.resume_mode == "auto" else None
        return None if step is None else self.ckpt.root / f"global_step_{step}"

    # ------------------------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, final: bool = False) -> Path:
        """Every rank calls it; the final checkpoint carries the exports (`export_writers`)."""
        extra = {**self.extra_state(), "global_step": self.global_step, "run_dir": str(self.run_dir.resolve())}
        writers = self.export_writers() if final or self.exports_every_save() else None
        with self.timer.stage("save_checkpoint"):
            if self.dist.is_distributed:
                from polyrl.distributed.checkpoint import save_sharded

                return save_sharded(self.ckpt, self.global_step, self.sharded_modules(), extra, self.dist,
                                    writers=writers)
            return self.ckpt.save(self.global_step, {**self.checkpoint_state(), "extra": extra}, writers=writers)

    def resume(self) -> None:
        """Load `self.resume_from` (if any) into this run: weights, optimizer, then the loop's extra state."""
        if self.resume_from is None:
            return
        from polyrl.distributed.checkpoint import is_sharded, load_sharded

        if is_sharded(self.resume_from):  # DCP: written at any process count
            extra = load_sharded(self.resume_from, self.sharded_modules())
        else:
            state = self.ckpt.load(self.resume_from)
            self.load_checkpoint_state(state)
            extra = state["extra"]
        self.global_step = int(extra["global_step"])
        self.load_extra_state(extra)
        print(f"polyrl: resumed from {self.resume_from} at step {self.global_step}", flush=True)

    def export_writers(self) -> dict:
        return {}

    def exports_every_save(self) -> bool:
        """Exports with every checkpoint, not only the final one (verl's checkpoint.save_contents has hf_model)."""
        return False

    def after_fit(self) -> None:
        pass

    # ------------------------------------------------------------------------------------------------ the loop
    def fit(self, progress=None) -> dict[str, float]:
        """Train to `total_steps` with the cadence above; returns the last validation metrics. `progress`: a bar
        to draw on (its owner closes it), else one is drawn when trainer.progress_bar is on and this is a terminal."""
        t = self.cfg.trainer
        self.val_history: list[dict] = []
        self.train_history: list[dict] = []
        last_val: dict[str, float] = {}
        if t.val_only or (t.val_before_train and self.global_step == 0):
            last_val = self._validate()
            if last_val:
                self.tracker.log(last_val, step=self.global_step)
            if t.val_only:
                self.tracker.close()
                return last_val
        bar = progress if progress is not None else progress_bar(self.total_steps, initial=self.global_step,
                                                                 desc=self.bar_label,
                                                                 enabled=t.progress_bar and self.dist.is_rank0)
        self._bar = bar
        label, key = self.progress_metric
        try:
            while self.global_step < self.total_steps:
                metrics = self.step()
                self.train_history.append(metrics)
                is_last = self.global_step >= self.total_steps
                if is_last or (t.test_freq > 0 and self.global_step % t.test_freq == 0):
                    last_val = self._validate()
                    metrics.update(last_val)
                with bar_lifted(bar):  # the logger's line never shares the bar's line
                    self.tracker.log(metrics, step=self.global_step)
                # after the step's row: a crash between the two leaves a row past the last checkpoint, which the
                # resumed run drops and writes again; the other order could lose the row of a checkpointed step
                # (the save's time goes in the next step's timings)
                if t.save_freq > 0 and self.global_step % t.save_freq == 0 and not is_last:
                    self.save_checkpoint()
                if bar is not None:
                    bar.update(1)
                    if metrics.get(key) is not None:
                        bar.set_postfix({label: f"{metrics[key]:.3f}"})
            self.final_checkpoint = self.save_checkpoint(final=True)
        finally:
            if bar is not None and progress is None:
                bar.close()
            self._bar = None
            self.tracker.close()
            self.profiler.close()
        self.after_fit()
        return last_val

    def _validate(self) -> dict[str, float]:
        metrics = self.validate()
        if metrics:
            self.val_history.append(metrics)
        return metrics
