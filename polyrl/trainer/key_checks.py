"""Keys that are accepted (they are verl's, so verl command lines parse) but have nothing to act on in polyrl.

Each is refused when set to anything but its default, with the reason in one sentence; none is silently ignored
(STYLE.md rule 13). `tests/test_config_keys_on_cpu.py` walks every key of `polyrl keys train|sft|flow` and fails
when a key is neither read by the code nor listed here, and sets each key listed here to a non-default value to check
that it is refused.

Keys refused for only some values (`rollout.enable_prefix_caching=False`, a `strategy` other than fsdp/fsdp2, ...)
are checked where their feature lives (trainer/checks.py); those checks read the key, so they are not listed here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from polyrl.errors import ConfigError

_NO_VERL_WORKERS = "polyrl runs in-process, without verl's workers"
_CHUNKED = ("polyrl always computes log-probs and entropy in LM-head chunks, recomputed in backward "
            "(learner/logprobs.py)")
_FUSED = f"{_CHUNKED}, which is the memory saving the fused kernels are for"
_FSDP_WRAP = "polyrl's FSDP2 wraps each transformer block (distributed/parallelize.py)"
_FSDP1 = "it is an FSDP1 flag and polyrl uses FSDP2, whose parameters are always the original ones"
_TRAINER_SETS = "the trainer sets it from the data and trainer.total_training_steps; set trainer.total_training_steps"
_VLM_JUDGE_HF = ("the VLM judge decodes with HF generate, since polyrl's engine has no vision tower "
                 "(rewards/vlm_judge.py)")
_CRITIC_FSDP = ("the critic is sharded over the actor's mesh with FSDP2's reshard_after_forward, forward_prefetch, "
                "dtype and mixed_precision only (no offload, no compile, no shard group of its own)")
_CRITIC_FSDP_READ = ("reshard_after_forward", "forward_prefetch", "dtype", "mixed_precision")

def _fsdp_cls():
    from polyrl.learner.config import FSDPConfig

    return FSDPConfig


_FSDP_REFUSED = {"wrap_policy": _FSDP_WRAP, "use_orig_params": _FSDP1}
_LLM_ROLE_FSDP = {f"actor_rollout_ref.{role}.fsdp_config.{k}": why for role in ("actor", "ref")
                  for k, why in _FSDP_REFUSED.items()}

REFUSED_KEYS: dict[str, dict[str, str]] = {
    "train": {
        "data.val_batch_size": "validation generates the whole validation set at once (the engine batches it by "
                               "rollout.max_num_seqs)",
        "data.filter_overlong_prompts_workers": "prompts are tokenized in one batched fast-tokenizer call",
        "data.dataloader_num_workers": "prompts are tokenized once at load time, so there is no loader worker",
        "actor_rollout_ref.model.use_shm": "models load from local disk, not through shared memory",
        "actor_rollout_ref.model.use_fused_kernels": _FUSED,
        "actor_rollout_ref.actor.use_fused_kernels": _FUSED,
        "actor_rollout_ref.actor.entropy_from_logits_with_chunking": _CHUNKED,
        "actor_rollout_ref.actor.entropy_checkpointing": _CHUNKED,
        "actor_rollout_ref.ref.entropy_from_logits_with_chunking": _CHUNKED,
        "actor_rollout_ref.ref.entropy_checkpointing": _CHUNKED,
        "actor_rollout_ref.ref.use_torch_compile": "the reference runs the actor's forward settings "
                                                   "(actor_rollout_ref.actor.use_torch_compile)",
        "actor_rollout_ref.actor.optim.total_training_steps": _TRAINER_SETS,
        "critic.optim.total_training_steps": _TRAINER_SETS,
        **_LLM_ROLE_FSDP,
        **{f"critic.model.fsdp_config.{f.name}": _CRITIC_FSDP for f in dataclasses.fields(_fsdp_cls())
           if f.name not in _CRITIC_FSDP_READ},
        "actor_rollout_ref.rollout.mode": f"{_NO_VERL_WORKERS}; the engine generates in the trainer's process",
        "actor_rollout_ref.rollout.load_format": "the trainer's weights are copied into the engine before the first "
                                                 "rollout",
        "actor_rollout_ref.rollout.data_parallel_size": "it is derived from the number of processes",
        **{f"critic.model.{k}": "the critic trains every weight (no LoRA)"
           for k in ("lora_rank", "lora_alpha", "target_modules")},
        "critic.shuffle": "the critic's epochs run over the mini-batches in order",
        "critic.checkpoint.async_save": "saves are synchronous and atomic",
        "algorithm.pf_ppo": "PF-PPO is not implemented (algorithm.use_pf_ppo is refused too)",
        "trainer.esi_redundant_time": "it belongs to verl's elastic instances",
        "trainer.use_legacy_worker_impl": _NO_VERL_WORKERS,
        "trainer.del_local_ckpt_after_load": "checkpoints are kept (trainer.max_actor_ckpt_to_keep bounds them)",
        "trainer.max_critic_ckpt_to_keep": "the critic is saved in the actor's checkpoint folder; use "
                                           "trainer.max_actor_ckpt_to_keep",
    },
    "sft": {
        "data.val_files": "`polyrl sft` has no validation pass",
        "model.use_fused_kernels": "`polyrl sft` computes the loss from full logits",
        "model.use_liger": "Liger kernels are not bundled with polyrl",
        "model.use_shm": "models load from local disk, not through shared memory",
    },
    "flow": {
        "algorithm.adv_estimator": "FlowGRPO's advantage (outcome GRPO broadcast to every trained step) is the one "
                                   "implemented",
        "actor_rollout_ref.actor.diffusion_loss.loss_mode": "the clipped FlowGRPO objective is the one implemented",
        "actor_rollout_ref.actor.fsdp_config.dtype": "the flow trainer computes in the weights' dtype; set "
                                                     "actor_rollout_ref.model.dtype",
        **{f"actor_rollout_ref.actor.fsdp_config.{k}": why for k, why in _FSDP_REFUSED.items()},
        **{f"reward.reward_model.rollout.{k}": _VLM_JUDGE_HF for k in ("name", "gpu_memory_utilization",
                                                                          "max_num_batched_tokens", "prompt_length")},
    },
}


def get_key(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def default_of(tree_type: type, key: str) -> Any:
    return get_key(tree_type(), key)


def refuse_unread(cfg: Any, tree: str) -> None:
    """Refuse every key of `REFUSED_KEYS[tree]` that is set to anything but its default."""
    for key, why in REFUSED_KEYS[tree].items():
        value, default = get_key(cfg, key), default_of(type(cfg), key)
        if value != default:
            raise ConfigError(f"{key}={value!r} is not available in polyrl: {why}. Remove it (default {default!r}).")
