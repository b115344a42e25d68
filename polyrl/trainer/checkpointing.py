"""The LLM trainer's checkpoints: what a step's state is and how it loads back, for the shared protocol in
`polyrl.trainer.core` (which saves it as one file set, or DCP shards with several processes, and resumes runs).
A mixin of `PPOTrainer` (it reads the trainer's model, optimizer, sampler, RNGs, engine and DistEnv).

Layout (verl's): `default_local_dir/global_step_N/` plus `latest_checkpointed_iteration.txt`; with several
processes `global_step_N/dcp/` holds torch.distributed.checkpoint shards that load at any process count. The last
checkpoint's `huggingface/` export is written in `trainer.export_dtype` (by default the input model's dtype).
"""

from __future__ import annotations

from pathlib import Path

import torch

from polyrl.errors import ConfigError
from polyrl.models.loader import merged_state_dict, save_hf, saved_weights_dtype
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


def trained_state(model) -> dict:
    """What a checkpoint holds of the policy: its whole state, or under LoRA the trained parameters only (the
    adapters: a few hundred MB beside Qwen3-30B-A3B's 57 GB frozen base, which resume loads from model.path)."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return dict(model.state_dict())
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in trained}


class CheckpointingMixin:
    """The LLM trainer's side of the checkpoint protocol (polyrl.trainer.core): what its state is and how it loads."""

    def checkpoint_state(self) -> dict:
        return {
            "model": trained_state(self.model),
            "optimizer": self.actor.optimizer.state_dict(),
            **({"critic": self.critic.model.state_dict(), "critic_optimizer": self.critic.optimizer.state_dict()}
               if self.critic is not None else {}),
        }

    def sharded_modules(self) -> dict:
        critic = {"critic": (self.critic.model, self.critic.optimizer)} if self.critic is not None else {}
        return {"model": (self.model, self.actor.optimizer), **critic}

    def extra_state(self) -> dict:
        engine_gen = self._engine_generator_state()
        if self.dist.is_distributed:  # one sampling stream per rank
            engine_gen = self.dist.all_gather_object(engine_gen)
        return {
            "scheduler": self.actor.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
            "generator": self.generator.get_state(),
            "engine_generator": engine_gen,
            "kl_coef": None if self.kl_ctrl is None else float(self.kl_ctrl.value),
        }

    def _engine_generator_state(self):
        """The engine's sampling-RNG position: a generator state (hf) or its call counter (native seeds per call)."""
        gen = getattr(self.engine, "generator", None)
        if gen is not None:
            return {"generator": gen.get_state()}
        return {"num_calls": int(getattr(self.engine, "num_calls", 0))}

    def export_writers(self) -> dict:
        return {"huggingface": self._export_hf_sharded if self.dist.is_distributed else self._export_hf}

    def _export_hf_sharded(self, out_dir: Path) -> None:
        from polyrl.distributed.checkpoint import gather_full_state_dict, without_aliases

        full = gather_full_state_dict(merged_state_dict(self.model).items(), self.dist)  # collective
        if self.dist.is_rank0:  # the unsharded replica is the plain HF class: its config names the real architecture
            from peft import PeftModel

            replica = self.rollout_replica  # under LoRA its base model: save_pretrained of peft writes adapters only
            replica = replica.get_base_model() if isinstance(replica, PeftModel) else replica
            save_hf(replica, out_dir, dtype=self.export_dtype, state_dict=without_aliases(full, replica))
            self.tokenizer.save_pretrained(out_dir)

    def _export_hf(self, out_dir: Path) -> None:
        from peft import PeftModel

        model = self.model
        if isinstance(model, PeftModel):  # merged weights, so no separate merge step is ever needed; the merge
            # copies only the adapted weights (a deep copy of the model would hold a second base on the GPU)
            save_hf(model.get_base_model(), out_dir, dtype=self.export_dtype, state_dict=merged_state_dict(model))
        else:
            save_hf(model, out_dir, dtype=self.export_dtype)
        self.tokenizer.save_pretrained(out_dir)

    def load_checkpoint_state(self, state: dict) -> None:
        missing = self.model.load_state_dict(state["model"], strict=False)
        lost = sorted(set(missing.missing_keys) & set(trained_state(self.model)))
        if lost:
            raise ConfigError(f"Checkpoint '{state['_path']}' does not match this model (missing "
                              f"{lost[:3]}); resume with the same model or set "
                              "trainer.resume_mode=disable.")
        if "optimizer" in state:
            self.actor.optimizer.load_state_dict(state["optimizer"])
        if self.critic is not None and "critic" in state:
            self.critic.model.load_state_dict(state["critic"])
            self.critic.optimizer.load_state_dict(state["critic_optimizer"])

    def load_extra_state(self, extra: dict) -> None:
        from polyrl.distributed.checkpoint import regroup_scheduler_state

        # sharded and replicated parameters are separate optimizer groups only with several processes
        self.actor.scheduler.load_state_dict(regroup_scheduler_state(extra["scheduler"],
                                                                     len(self.actor.optimizer.param_groups)))
        self.sampler.load_state_dict(extra["sampler"])
        set_rng_state(extra["rng"])
        self.generator.set_state(extra["generator"])
        eng = extra.get("engine_generator") or {}
        if isinstance(eng, list):  # per-rank sampling streams; a different process count starts fresh ones
            eng = (eng[self.dist.rank] if len(eng) == self.dist.world_size else None) or {}
        if "generator" in eng and getattr(self.engine, "generator", None) is not None:
            self.engine.generator.set_state(eng["generator"])
        if "num_calls" in eng and hasattr(self.engine, "num_calls"):
            self.engine.num_calls = eng["num_calls"]
        if self.kl_ctrl is not None and extra.get("kl_coef") is not None:
            self.kl_ctrl.value = extra["kl_coef"]
        self.engine.update_weights(self._weights_for_rollout())
