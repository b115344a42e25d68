"""The LLM trainer's checkpoints: what a step's state is, how it is saved (one file set, or DCP shards with several
processes) and how a run resumes from it. A mixin of `PPOTrainer` (it reads the trainer's model, optimizer, sampler,
RNGs, engine and DistEnv); the atomic write itself is `polyrl.utils.checkpoint.CheckpointManager`'s.

Layout (verl's): `default_local_dir/global_step_N/` plus `latest_checkpointed_iteration.txt`; with several
processes `global_step_N/dcp/` holds torch.distributed.checkpoint shards that load at any process count. The last
checkpoint's `huggingface/` export is written in `trainer.export_dtype` (by default the input model's dtype).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from polyrl.errors import ConfigError
from polyrl.models.loader import merged_state_dict, save_hf, saved_weights_dtype
from polyrl.trainer import run_dirs
from polyrl.utils.checkpoint import rng_state, set_rng_state
from polyrl.utils.device import DTYPES


def export_dtype(name: str, model_path: str | None, *, trained: torch.dtype) -> torch.dtype:
    """trainer.export_dtype: `auto` is the dtype the input model's weights are stored in (a bf16 model exports as
    bf16, not as the fp32 master weights), or the trained dtype when the input does not say."""
    if name == "auto":
        return saved_weights_dtype(model_path) or trained
    if name not in DTYPES:
        raise ConfigError(f"trainer.export_dtype={name!r} is not a dtype; use auto (the input model's dtype), "
                          "float32, bfloat16 or float16.")
    return DTYPES[name]


class CheckpointingMixin:
    def _state(self) -> dict:
        model_sd = {k: v for k, v in self.model.state_dict().items()}
        return {
            "model": model_sd,
            "optimizer": self.actor.optimizer.state_dict(),
            **({"critic": self.critic.model.state_dict(), "critic_optimizer": self.critic.optimizer.state_dict()}
               if self.critic is not None else {}),
            "extra": {
                "global_step": self.global_step,
                "scheduler": self.actor.scheduler.state_dict(),
                "sampler": self.sampler.state_dict(),
                "rng": rng_state(),
                "generator": self.generator.get_state(),
                "engine_generator": self._engine_generator_state(),
                "kl_coef": None if self.kl_ctrl is None else float(self.kl_ctrl.value),
                "run_dir": str(self.run_dir.resolve()),  # a resumed run goes on writing there
            },
        }

    def _engine_generator_state(self):
        """The engine's sampling-RNG position: a generator state (hf) or its call counter (native seeds per call)."""
        gen = getattr(self.engine, "generator", None)
        if gen is not None:
            return {"generator": gen.get_state()}
        return {"num_calls": int(getattr(self.engine, "num_calls", 0))}

    def save_checkpoint(self, export_hf: bool = False) -> Path:
        if self.dist.is_distributed:
            return self._save_sharded(export_hf)
        with self.timer.stage("save_checkpoint"):
            writers = {"huggingface": self._export_hf} if export_hf else None
            return self.ckpt.save(self.global_step, self._state(), writers=writers)

    # sharded checkpoints (polyrl.distributed.checkpoint): every rank writes its own shards, rank 0 the rest
    def _save_sharded(self, export_hf: bool) -> Path:
        from polyrl.distributed.checkpoint import save_sharded

        with self.timer.stage("save_checkpoint"):
            extra = self._state()["extra"]
            extra["engine_generator"] = self.dist.all_gather_object(extra["engine_generator"])  # one per rank
            writers = {"huggingface": self._export_hf_sharded} if export_hf else None
            return save_sharded(self.ckpt, self.global_step, self.model, self.actor.optimizer, extra, self.dist,
                                writers=writers)

    def _export_hf_sharded(self, out_dir: Path) -> None:
        from polyrl.distributed.checkpoint import gather_full_state_dict, without_aliases

        full = gather_full_state_dict(merged_state_dict(self.model).items(), self.dist)  # collective
        if self.dist.is_rank0:  # the unsharded replica is the plain HF class: its config names the real architecture
            full = without_aliases(full, self.rollout_replica)
            save_hf(self.rollout_replica, out_dir, dtype=self.export_dtype, state_dict=full)
            self.tokenizer.save_pretrained(out_dir)

    def _load_sharded(self, state: dict) -> bool:
        from polyrl.distributed.checkpoint import is_sharded, load_sharded, regroup_scheduler_state

        if not is_sharded(state["_path"]):
            return False
        load_sharded(state["_path"], self.model, self.actor.optimizer)
        state["extra"]["scheduler"] = regroup_scheduler_state(state["extra"]["scheduler"],
                                                              len(self.actor.optimizer.param_groups))
        gens = state["extra"].get("engine_generator")
        if isinstance(gens, list):  # per-rank sampling streams; a different process count starts fresh ones
            state["extra"]["engine_generator"] = gens[self.dist.rank] if len(gens) == self.dist.world_size else None
        return True

    def _export_hf(self, out_dir: Path) -> None:
        from peft import PeftModel

        model = self.model
        if isinstance(model, PeftModel):  # export merged weights so no separate merge step is ever needed
            model = copy.deepcopy(model).merge_and_unload()
        save_hf(model, out_dir, dtype=self.export_dtype)
        self.tokenizer.save_pretrained(out_dir)

    def _resume_path(self) -> Path | None:
        """The checkpoint folder this run resumes from (trainer.resume_mode), or None for a fresh run."""
        t = self.cfg.trainer
        if t.resume_mode == "resume_path":
            path = Path(t.resume_from_path)
            if not path.is_dir():
                raise ConfigError(f"Checkpoint folder '{path}' does not exist; check trainer.resume_from_path.")
            return path
        step = self.ckpt.latest_step() if t.resume_mode == "auto" else None
        return None if step is None else self.ckpt.root / f"global_step_{step}"

    def _open_run_dir(self) -> Path:
        """This run's directory (polyrl.trainer.run_dirs), the same on every rank; recorded in cfg.trainer.run_dir."""
        t = self.cfg.trainer
        resumed = run_dirs.checkpoint_run(self.resume_from) if self.resume_from is not None else None
        run = run_dirs.chosen_run_dir(t.run_dir, resumed)  # the same answer on every rank: it only reads files
        if self.dist.is_rank0:
            if run is None:
                run = run_dirs.fresh_run_dir(Path("runs") / t.project_name / t.experiment_name)
            run.mkdir(parents=True, exist_ok=True)
            if resumed is not None and (dropped := run_dirs.drop_rows_after(run, resumed[1])):
                print(f"polyrl: dropped {dropped} metrics rows past step {resumed[1]} from {run / run_dirs.METRICS} "
                      "(this run trains those steps again)", flush=True)
        run = Path(self.dist.broadcast_object(str(run) if run is not None else None))
        t.run_dir = str(run)
        return run

    def _maybe_resume(self) -> None:
        if self.resume_from is None:
            return
        state = self.ckpt.load(self.resume_from)
        sharded = self._load_sharded(state)  # DCP: model + optimizer, written at any process count
        missing = None if sharded else self.model.load_state_dict(state["model"], strict=False)
        if missing and missing.missing_keys and any("lora" not in k for k in missing.missing_keys):
            raise ConfigError(f"Checkpoint '{state['_path']}' does not match this model (missing "
                              f"{missing.missing_keys[:3]}); resume with the same model or set "
                              "trainer.resume_mode=disable.")
        if "optimizer" in state:
            self.actor.optimizer.load_state_dict(state["optimizer"])
        if self.critic is not None and "critic" in state:
            self.critic.model.load_state_dict(state["critic"])
            self.critic.optimizer.load_state_dict(state["critic_optimizer"])
        extra = state["extra"]
        self.global_step = int(extra["global_step"])
        self.actor.scheduler.load_state_dict(extra["scheduler"])
        self.sampler.load_state_dict(extra["sampler"])
        set_rng_state(extra["rng"])
        self.generator.set_state(extra["generator"])
        eng = extra.get("engine_generator") or {}
        if "generator" in eng and getattr(self.engine, "generator", None) is not None:
            self.engine.generator.set_state(eng["generator"])
        if "num_calls" in eng and hasattr(self.engine, "num_calls"):
            self.engine.num_calls = eng["num_calls"]
        if self.kl_ctrl is not None and extra.get("kl_coef") is not None:
            self.kl_ctrl.value = extra["kl_coef"]
        self.engine.update_weights(self._weights_for_rollout())
        print(f"polyrl: resumed from {state['_path']} at step {self.global_step}", flush=True)
