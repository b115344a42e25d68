#!/usr/bin/env bash
# verl's GRPO example (seed 002: DeepSeek-R1-Distill-Qwen-7B, 8x8 GPUs) with `python3 -m verl.trainer.main_ppo`
# replaced by `polyrl train`. Same keys; batch sizes and lengths scaled down by the variables below so it also runs
# on a laptop. Keys that need hardware or software that is absent are refused with one sentence naming the fix,
# e.g. on a CPU: rollout.name=sglang -> use native; tensor_model_parallel_size=2 -> use 1; param_offload -> False;
# ulysses_sequence_parallel_size=4 -> 1. Override them by appending KEY=VALUE arguments ("$@" comes last).
set -euo pipefail
math_train_path=${TRAIN:-$HOME/data/gsm8k/train.parquet}
math_test_path=${VAL:-$HOME/data/gsm8k/test.parquet}
model_path=${MODEL:-/mnt/public/hf_models/DeepSeek-R1-Distill-Qwen-7B}

polyrl train \
    algorithm.adv_estimator=grpo \
    data.train_files="$math_train_path" \
    data.val_files="$math_test_path" \
    data.train_batch_size=${BATCH:-128} \
    data.max_prompt_length=${PROMPT_LEN:-1024} \
    data.max_response_length=${RESPONSE_LEN:-27648} \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path="$model_path" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=${MINI_BATCH:-32} \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=True \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=4 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1 \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=${MAX_TOKENS:-30000} \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${MAX_TOKENS:-30000} \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=${MAX_TOKENS:-30000} \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=sglang \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    actor_rollout_ref.rollout.n=${N:-16} \
    actor_rollout_ref.rollout.temperature=0.6 \
    actor_rollout_ref.rollout.top_k=1000000 \
    actor_rollout_ref.rollout.top_p=1.0 \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","tensorboard"]' \
    trainer.project_name='verl_grpo_boba' \
    trainer.experiment_name='ds_7b_fsdp_sglang' \
    trainer.n_gpus_per_node=${GPUS:-8} \
    trainer.nnodes=${NODES:-8} \
    trainer.val_before_train=False \
    trainer.save_freq=50 \
    trainer.test_freq=-1 \
    trainer.total_epochs=15000 "$@"
