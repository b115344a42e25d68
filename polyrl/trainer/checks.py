"""Up-front checks of a resolved `PPOConfig`: fail before any model is loaded, with the numbers in the message.

Two kinds of checks:
- batch arithmetic (verl's semantics: train_batch_size and ppo_mini_batch_size count prompts, micro-batch sizes count
  sequences per GPU);
- keys whose feature needs hardware or software that is not here. They are refused with one sentence saying why and
  what to use instead; nothing is silently ignored.
"""

from __future__ import annotations

import importlib.util

from polyrl.algorithms.rollout_correction import check_rollout_correction
from polyrl.errors import ConfigError
from polyrl.learner.config import micro_batch_per_gpu, mini_batch_per_gpu
from polyrl.rewards.model_reward import resolve_reward_model
from polyrl.trainer.async_config import check_async
from polyrl.trainer.core import check_resume
from polyrl.trainer.key_checks import refuse_unread


def _gpus_available() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def world_size(cfg) -> int:
    """The trainer's processes: the job's, less the off-policy pipeline's rollout pool."""
    import os

    from polyrl.trainer.job import rollout_pool_size

    return max(1, int(os.environ.get("WORLD_SIZE", "1")) - rollout_pool_size(cfg))


NATIVE_ENGINE_KWARGS = {"block_size", "num_kv_tokens", "fp8_min_elements", "decode_kernel", "fp8_lm_head",
                        "prefill_kernel", "fp8_splitk"}
NATIVE_ENGINE_SWITCHES = ("fp8_lm_head", "prefill_kernel", "fp8_splitk")  # True or False


def _check_low_precision_rollout(r) -> None:
    from polyrl.rollout.native.attention import DECODE_KERNEL_CHOICES
    from polyrl.rollout.native.engine import KV_CACHE_DTYPES, QUANTIZATIONS

    if r.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"actor_rollout_ref.rollout.kv_cache_dtype={r.kv_cache_dtype!r} is not supported; use auto "
                          "(the model dtype) or fp8 (e4m3 with per-token scales).")
    if r.quantization not in QUANTIZATIONS:
        raise ConfigError(f"actor_rollout_ref.rollout.quantization={r.quantization!r} is not supported; use fp8 or "
                          "leave it unset (null).")
    for backend, kwargs in (r.engine_kwargs or {}).items():
        bad = sorted(set(kwargs or {}) - NATIVE_ENGINE_KWARGS) if backend == "native" else sorted(kwargs or {})
        if bad:
            raise ConfigError(f"actor_rollout_ref.rollout.engine_kwargs.{backend}.{bad[0]} is not read by polyrl's "
                              f"engine; engine_kwargs.native takes {sorted(NATIVE_ENGINE_KWARGS)}. Remove the key.")
    native = (r.engine_kwargs or {}).get("native") or {}
    for key in NATIVE_ENGINE_SWITCHES:
        if not isinstance(native.get(key, False), bool):
            raise ConfigError(f"actor_rollout_ref.rollout.engine_kwargs.native.{key}={native[key]!r} is not a "
                              "boolean; set it to True or False.")
    kernel = native.get("decode_kernel", "auto")
    if kernel not in DECODE_KERNEL_CHOICES:
        raise ConfigError(f"actor_rollout_ref.rollout.engine_kwargs.native.decode_kernel={kernel!r} is not a decode "
                          f"kernel; use one of {list(DECODE_KERNEL_CHOICES)} (auto, the default, picks v2, or v1 where "
                          "v2 cannot run).")
    if r.name != "native" and (r.kv_cache_dtype != "auto" or r.quantization is not None):
        raise ConfigError(f"actor_rollout_ref.rollout.kv_cache_dtype/quantization need rollout.name=native (got "
                          f"rollout.name={r.name}); set rollout.name=native or drop the FP8 keys.")


def check_batch_sizes(cfg) -> None:
    d, a, r = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    ws = world_size(cfg) // max(1, a.ulysses_sequence_parallel_size)  # data shards (Ulysses groups share data)
    if d.train_batch_size < 1:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size} must be at least 1.")
    if r.n < 1:
        raise ConfigError(f"actor_rollout_ref.rollout.n={r.n} must be at least 1.")
    if a.ppo_mini_batch_size < 1 or a.ppo_mini_batch_size > d.train_batch_size:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={a.ppo_mini_batch_size} must be between 1 and "
            f"data.train_batch_size={d.train_batch_size} (both count prompts).")
    if d.train_batch_size % a.ppo_mini_batch_size:
        raise ConfigError(
            f"data.train_batch_size={d.train_batch_size} is not divisible by actor_rollout_ref.actor."
            f"ppo_mini_batch_size={a.ppo_mini_batch_size}; pick a mini-batch size that divides it.")
    seqs_per_mini = a.ppo_mini_batch_size * r.n
    if seqs_per_mini % ws:
        raise ConfigError(
            f"ppo_mini_batch_size * rollout.n = {a.ppo_mini_batch_size} * {r.n} = {seqs_per_mini} sequences cannot be "
            f"split evenly over {ws} processes; make it a multiple of {ws}.")
    if (d.train_batch_size * r.n) % ws:
        raise ConfigError(
            f"data.train_batch_size * rollout.n = {d.train_batch_size * r.n} is not divisible by the {ws} processes.")
    if a.ppo_micro_batch_size is not None and a.ppo_micro_batch_size_per_gpu is not None:
        raise ConfigError("Set only one of actor.ppo_micro_batch_size (deprecated, global) and "
                          "actor.ppo_micro_batch_size_per_gpu.")
    micro = micro_batch_per_gpu(a.ppo_micro_batch_size_per_gpu, a.ppo_micro_batch_size, ws)
    if not a.use_dynamic_bsz:
        if micro is None:
            raise ConfigError("Set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (sequences per forward/"
                              "backward), or use_dynamic_bsz=True with ppo_max_token_len_per_gpu.")
        per_gpu = mini_batch_per_gpu(a.ppo_mini_batch_size, r.n, ws)
        if micro < 1 or micro > per_gpu:
            raise ConfigError(
                f"actor.ppo_micro_batch_size_per_gpu={micro} must be between 1 and the {per_gpu} sequences each GPU "
                f"gets per mini-batch (ppo_mini_batch_size {a.ppo_mini_batch_size} * n {r.n} / {ws} GPUs).")
        if per_gpu % micro:
            raise ConfigError(
                f"The {per_gpu} sequences per GPU per mini-batch (ppo_mini_batch_size {a.ppo_mini_batch_size} * n "
                f"{r.n} / {ws} GPUs) are not divisible by actor.ppo_micro_batch_size_per_gpu={micro}.")
    elif (a.ppo_max_token_len_per_gpu is not None  # None: auto (training/memory.py), never below one sequence
          and a.ppo_max_token_len_per_gpu < d.max_prompt_length + d.max_response_length):
        raise ConfigError(
            f"actor.ppo_max_token_len_per_gpu={a.ppo_max_token_len_per_gpu} is below one full sequence "
            f"(max_prompt_length {d.max_prompt_length} + max_response_length {d.max_response_length}); raise it.")
    if d.gen_batch_size is not None and d.gen_batch_size < d.train_batch_size:
        raise ConfigError(f"data.gen_batch_size={d.gen_batch_size} must be at least data.train_batch_size="
                          f"{d.train_batch_size}.")


def check_tensor_parallel(cfg) -> None:
    """Rollout tensor parallelism (rollout/native/tensor_parallel.py): None is auto (learner/memory.py picks it); a
    set size must split one node's GPUs (or, on CPU, the processes) into whole replicas. The model's heads are
    checked where the model is known (`tensor_parallel.check_divides`)."""
    import os

    from polyrl.distributed.launch import gpus_per_node

    r = cfg.actor_rollout_ref.rollout
    tp = r.tensor_model_parallel_size
    key = f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}"
    if tp is None or tp == 1:
        return
    if tp < 1:
        raise ConfigError(f"{key} must be at least 1 (or null: auto).")
    if r.name != "native":
        raise ConfigError(f"{key}: tensor parallelism is in the native engine only; use rollout.name=native or 1.")
    if not cfg.actor_rollout_ref.hybrid_engine:  # the off-policy rollout pool: replicas within one of its nodes
        per_node = cfg.rollout.n_gpus_per_node
        if tp > per_node or per_node % tp:
            raise ConfigError(f"{key} does not divide the rollout pool's rollout.n_gpus_per_node={per_node}; use a "
                              f"divisor of {per_node}.")
        return
    ngpu = _gpus_available()
    per_node = gpus_per_node(cfg.trainer.n_gpus_per_node) if ngpu else int(os.environ.get("WORLD_SIZE", "0")) or \
        cfg.trainer.n_gpus_per_node
    what = "GPUs of a node (trainer.n_gpus_per_node)" if ngpu else "processes"
    if tp > per_node or per_node % tp:
        raise ConfigError(f"{key} does not divide the {per_node} {what}; use a divisor of {per_node}.")
    if cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size > 1:
        raise ConfigError(f"{key} with actor.ulysses_sequence_parallel_size > 1 is not supported yet (both group "
                          "consecutive ranks); use one of them.")


def check_sequence_parallel(cfg) -> None:
    """Ulysses (polyrl/distributed/ulysses.py): the actor's degree, which the reference shares; no critic SP."""
    import os

    roles = cfg.actor_rollout_ref
    sp, ref_sp = roles.actor.ulysses_sequence_parallel_size, roles.ref.ulysses_sequence_parallel_size
    if cfg.critic.ulysses_sequence_parallel_size != 1:
        raise ConfigError(f"critic.ulysses_sequence_parallel_size={cfg.critic.ulysses_sequence_parallel_size}: the "
                          "critic has no sequence parallelism in polyrl; set it to 1.")
    if sp < 1:
        raise ConfigError(f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} must be at least 1.")
    if ref_sp not in (1, sp):  # 1 is the default: like verl's interpolated default, the reference follows the actor
        raise ConfigError(f"actor_rollout_ref.ref.ulysses_sequence_parallel_size={ref_sp} differs from the actor's "
                          f"{sp}; the reference runs on the actor's sequence-parallel groups, so set it to {sp}.")
    if sp == 1:
        return
    if not roles.model.use_remove_padding:
        raise ConfigError(f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} splits the packed row and "
                          "needs actor_rollout_ref.model.use_remove_padding=True.")
    procs = int(os.environ.get("WORLD_SIZE", "0")) or cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    if procs % sp:
        raise ConfigError(f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} does not divide the {procs} "
                          f"processes; use a divisor of {procs}.")


def check_strategies(cfg) -> None:
    """verl's fsdp and fsdp2 both name polyrl's FSDP2 engine; each role's `strategy` (and its `fsdp_config.strategy`
    alias) must be one of them."""
    roles = cfg.actor_rollout_ref
    for key, value in (("actor_rollout_ref.actor.strategy", roles.actor.strategy),
                       ("actor_rollout_ref.actor.fsdp_config.strategy", roles.actor.fsdp_config.strategy),
                       ("actor_rollout_ref.ref.strategy", roles.ref.strategy),
                       ("actor_rollout_ref.ref.fsdp_config.strategy", roles.ref.fsdp_config.strategy),
                       ("critic.strategy", cfg.critic.strategy)):
        if value not in (None, "fsdp", "fsdp2"):
            raise ConfigError(f"{key}={value!r} is not available; use fsdp2 (megatron is not bundled).")


def check_rollout_switches(r) -> None:
    """Switches of verl's engines that polyrl's native engine has always on."""
    if r.name == "native" and not r.enable_prefix_caching:
        raise ConfigError("actor_rollout_ref.rollout.enable_prefix_caching=False: the native engine always shares a "
                          "prompt's KV blocks among its n samples; set it to True (or use rollout.name=hf, which "
                          "shares nothing).")
    if r.name == "native" and not r.enable_chunked_prefill:
        raise ConfigError("actor_rollout_ref.rollout.enable_chunked_prefill=False: the native engine always splits "
                          "prefills into chunks of rollout.max_num_batched_tokens; set it to True and raise "
                          "max_num_batched_tokens for larger chunks.")
    if not r.calculate_log_probs:
        raise ConfigError("actor_rollout_ref.rollout.calculate_log_probs=False: the engines always return the "
                          "sampled tokens' log-probs (rollout correction and training/rollout_probs_diff_mean read "
                          "them); set it to True.")


def check_critic(critic) -> None:
    """Token-budget micro-batches are the actor's alone; the critic cuts micro-batches by sequence count."""
    if not critic.enable:
        return
    default = type(critic)()
    for key, value, unset in (("use_dynamic_bsz", critic.use_dynamic_bsz, default.use_dynamic_bsz),
                              ("ppo_max_token_len_per_gpu", critic.ppo_max_token_len_per_gpu,
                               default.ppo_max_token_len_per_gpu),
                              ("forward_max_token_len_per_gpu", critic.forward_max_token_len_per_gpu,
                               default.forward_max_token_len_per_gpu)):
        if value != unset:
            raise ConfigError(f"critic.{key}={value!r}: the critic cuts micro-batches by sequence count, not by token "
                              "budget; remove it and set critic.ppo_micro_batch_size_per_gpu.")


CHECKPOINT_CONTENTS = ("model", "optimizer", "extra")


def check_checkpoint_contents(role: str, ckpt) -> None:
    """verl's contents: polyrl always saves and loads model, optimizer and extra (a resume needs all three); hf_model
    adds the HF export to every checkpoint (the final one always has it)."""
    for name, contents in (("save_contents", ckpt.save_contents), ("load_contents", ckpt.load_contents)):
        hf = name == "save_contents" and role.endswith("actor")  # the critic has no HF export
        allowed = CHECKPOINT_CONTENTS + (("hf_model",) if hf else ())
        unknown = [c for c in contents if c not in allowed]
        missing = [c for c in CHECKPOINT_CONTENTS if c not in contents]
        if unknown or missing:
            raise ConfigError(f"{role}.checkpoint.{name}={list(contents)}: polyrl checkpoints always hold model, "
                              "optimizer and extra; "
                              f"use {list(allowed)}.")


def check_gdpo(alg) -> None:
    """gdpo's keys are read only by gdpo, and gdpo needs its components named."""
    is_gdpo = alg.adv_estimator == "gdpo"
    if is_gdpo and not alg.gdpo_reward_keys:
        raise ConfigError("algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the reward function's extra "
                          "keys to normalise separately, e.g. '[format_reward,accuracy_reward]'.")
    for key in ("gdpo_reward_keys", "gdpo_reward_weights"):
        if getattr(alg, key) is not None and not is_gdpo:
            raise ConfigError(f"algorithm.{key} is read by adv_estimator=gdpo only; remove it or use gdpo.")
    if is_gdpo and alg.gdpo_reward_weights is not None and len(alg.gdpo_reward_weights) != len(alg.gdpo_reward_keys):
        raise ConfigError(f"algorithm.gdpo_reward_weights has {len(alg.gdpo_reward_weights)} values for "
                          f"{len(alg.gdpo_reward_keys)} gdpo_reward_keys; give one weight per key.")


def check_supported(cfg) -> None:
    """Refuse settings polyrl cannot honour here, each with the reason and the alternative."""
    roles = cfg.actor_rollout_ref
    r = roles.rollout
    ngpu = _gpus_available()
    check_async(cfg)
    if r.name in ("vllm", "sglang", "trtllm"):
        installed = importlib.util.find_spec(r.name) is not None
        raise ConfigError(
            f"actor_rollout_ref.rollout.name={r.name} is {'installed but not wired into polyrl' if installed else 'not installed'}; "
            "use rollout.name=native (polyrl's own engine, no extra dependency) or rollout.name=hf.")
    from polyrl.rollout import rollout_backends

    if r.name not in rollout_backends():
        raise ConfigError(f"actor_rollout_ref.rollout.name={r.name!r} is unknown; use one of "
                          f"{sorted(rollout_backends())}.")
    _check_low_precision_rollout(r)
    check_tensor_parallel(cfg)
    check_sequence_parallel(cfg)
    for role, fsdp in (("actor", roles.actor.fsdp_config), ("ref", roles.ref.fsdp_config)):
        if fsdp.cpu_offload and ngpu == 0:
            raise ConfigError(
                f"actor_rollout_ref.{role}.fsdp_config.param_offload/optimizer_offload offload GPU memory to the CPU, "
                "and there is no GPU here; set them to False on a CPU machine.")
    if roles.model.enable_activation_offload and ngpu == 0:
        raise ConfigError("actor_rollout_ref.model.enable_activation_offload needs a GPU; set it to False on CPU.")
    if roles.model.use_liger:
        raise ConfigError("actor_rollout_ref.model.use_liger: Liger kernels are not bundled with polyrl; set it to "
                          "False (polyrl computes log-probs in LM-head chunks without it).")
    check_strategies(cfg)
    check_rollout_switches(r)
    check_critic(cfg.critic)
    for role, contents in (("actor_rollout_ref.actor", roles.actor.checkpoint), ("critic", cfg.critic.checkpoint)):
        check_checkpoint_contents(role, contents)
    if cfg.reward_model.reward_manager not in ("naive", "dapo"):
        raise ConfigError(f"reward_model.reward_manager={cfg.reward_model.reward_manager!r} is not available; use "
                          "naive or dapo (both apply reward_model.overlong_buffer when it is enabled).")
    refuse_unread(cfg, "train")
    if cfg.trainer.nnodes > 1 and importlib.util.find_spec("ray") is None:
        raise ConfigError(f"trainer.nnodes={cfg.trainer.nnodes} needs Ray for multi-node placement; "
                          "`pip install 'polyrl[ray]'` or run on one node.")
    want = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    if ngpu and want > ngpu and cfg.trainer.nnodes == 1:
        raise ConfigError(f"trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node} but only {ngpu} GPU(s) are "
                          f"visible; set it to {ngpu} or fewer.")
    resolve_reward_model(cfg)  # verl's two reward-model layouts; conflicting or ignored keys (rewards/model_reward.py)
    if cfg.algorithm.use_pf_ppo:
        raise ConfigError("algorithm.use_pf_ppo is not implemented; set it to False.")
    check_rollout_correction(cfg.algorithm.rollout_correction)
    check_gdpo(cfg.algorithm)
    check_multi_turn(cfg)
    if cfg.trainer.default_hdfs_dir:
        raise ConfigError("trainer.default_hdfs_dir: HDFS upload is not supported; leave it null and copy "
                          "trainer.default_local_dir yourself.")
    if roles.actor.checkpoint.async_save:
        raise ConfigError("actor.checkpoint.async_save is not implemented (saves are synchronous and atomic); "
                          "set it to False.")
    check_resume(cfg.trainer)


def resolve_model_dtype(model_cfg, fsdp, fsdp_key: str, model_key: str = "actor_rollout_ref.model.dtype") -> None:
    """verl's `fsdp_config.model_dtype` is the dtype the FSDP-wrapped model is built in, which is polyrl's
    `model.dtype`: a non-default model_dtype sets model.dtype (in place); the default fp32 defers to model.dtype."""
    from polyrl.utils.device import to_dtype

    if fsdp.model_dtype == type(fsdp)().model_dtype:
        return
    asked = to_dtype(fsdp.model_dtype, fsdp_key)
    if model_cfg.dtype != type(model_cfg)().dtype and to_dtype(model_cfg.dtype, model_key) != asked:
        raise ConfigError(f"{fsdp_key}={fsdp.model_dtype} and {model_key}={model_cfg.dtype} disagree: both are the "
                          "trained weights' dtype; set only one of them.")
    model_cfg.dtype = str(asked).removeprefix("torch.")


def resolve_model_dtypes(cfg) -> None:
    """The actor's fsdp_config.model_dtype (see resolve_model_dtype); the reference is a copy of the actor, so its
    model_dtype may only repeat the actor's."""
    from polyrl.utils.device import to_dtype

    roles = cfg.actor_rollout_ref
    resolve_model_dtype(roles.model, roles.actor.fsdp_config, "actor_rollout_ref.actor.fsdp_config.model_dtype")
    ref = roles.ref.fsdp_config
    key = "actor_rollout_ref.ref.fsdp_config.model_dtype"
    actor_dtype = to_dtype(roles.model.dtype, "actor_rollout_ref.model.dtype")
    if ref.model_dtype != type(ref)().model_dtype and to_dtype(ref.model_dtype, key) != actor_dtype:
        raise ConfigError(f"{key}={ref.model_dtype}: the reference is a copy of the actor, built in "
                          f"actor_rollout_ref.model.dtype={roles.model.dtype}; remove it.")


def check_flow_supported(cfg) -> None:
    """`polyrl flow train`: the keys refused for some values, then those with nothing to act on (key_checks.py)."""
    a = cfg.actor_rollout_ref.actor
    resolve_model_dtype(cfg.actor_rollout_ref.model, a.fsdp_config, "actor_rollout_ref.actor.fsdp_config.model_dtype")
    if a.fsdp_config.strategy not in (None, "fsdp", "fsdp2"):
        raise ConfigError(f"actor_rollout_ref.actor.fsdp_config.strategy={a.fsdp_config.strategy!r} is not "
                          "available; use fsdp2.")
    refuse_unread(cfg, "flow")
    from polyrl.rewards.vlm_judge import judge_spec

    judge_spec(cfg.reward.reward_model)  # a VLM judge's directory and judge file, or its keys set while it is off


def check_multi_turn(cfg) -> None:
    """multi_turn.* and agent.* act only with multi_turn.enable; multi-turn runs on-policy and in the off-policy
    pipeline."""
    from polyrl.agents.config import AgentConfig, MultiTurnConfig

    r = cfg.actor_rollout_ref.rollout
    key = "actor_rollout_ref.rollout.multi_turn"
    if not r.multi_turn.enable:
        if r.multi_turn != MultiTurnConfig(enable=False) or r.agent != AgentConfig():
            raise ConfigError(f"{key}.* or actor_rollout_ref.rollout.agent.* is set but {key}.enable is False; set "
                              f"{key}.enable=True to run agent loops, or remove those keys.")
        return
    if r.name not in ("native", "hf"):
        raise ConfigError(f"{key}.enable=True runs on rollout.name=native or hf, not {r.name!r}.")
    if cfg.algorithm.adv_estimator == "remax":
        raise ConfigError(f"{key}.enable=True with algorithm.adv_estimator=remax: the greedy baseline is a single-turn "
                          "rollout; use grpo, rloo or gae.")
