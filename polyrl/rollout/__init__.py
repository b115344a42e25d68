"""Text-generation backends behind one interface (`polyrl.rollout.base.RolloutEngine`)."""

from __future__ import annotations

import torch

from polyrl.rollout.base import ROLLOUT_BACKENDS, Rollout, RolloutEngine, SamplingParams, register_rollout


def make_rollout(cfg, model, *, pad_token_id: int, device: torch.device, max_model_len: int) -> RolloutEngine:
    """Build the engine named by `actor_rollout_ref.rollout.name` around the actor's (merged) weights."""
    if cfg.name == "hf":
        from polyrl.rollout.hf import HFRollout

        return HFRollout(model, pad_token_id=pad_token_id, seed=cfg.seed, max_batch_size=cfg.max_num_seqs)
    if cfg.name == "native":
        from polyrl.rollout.native.engine import NativeEngine

        from polyrl.utils.device import to_dtype

        dtype = torch.float32 if device.type == "cpu" else to_dtype(cfg.dtype, "actor_rollout_ref.rollout.dtype")
        return NativeEngine.from_hf(
            _merged_view(model), device=device, dtype=dtype, gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len or max_model_len, enforce_eager=cfg.enforce_eager, seed=cfg.seed,
            kv_cache_dtype=cfg.kv_cache_dtype, quantization=cfg.quantization, **(cfg.engine_kwargs.get("native") or {}))
    raise KeyError(cfg.name)  # checks.check_supported refuses other names with a user-facing message


class _MergedLoRAView:
    """What `NativeEngine.from_hf` reads from an HF model (config, rope, parameters, state dict), for a peft model:
    the base model's attributes with the LoRA adapters merged into the weights, under plain HF names."""

    def __init__(self, peft_model):
        from polyrl.models.loader import merged_state_dict

        self._base = peft_model.get_base_model()
        self._state = merged_state_dict(peft_model)

    def state_dict(self):
        return self._state

    def __getattr__(self, name):
        return getattr(self._base, name)


def _merged_view(model):
    from peft import PeftModel

    return _MergedLoRAView(model) if isinstance(model, PeftModel) else model


__all__ = ["ROLLOUT_BACKENDS", "Rollout", "RolloutEngine", "SamplingParams", "make_rollout", "register_rollout"]
