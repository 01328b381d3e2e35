#!/usr/bin/env bash
# GRPO of a Qwen3 model with vLLM rollouts on a Ray cluster (verl 0.9.x main_ppo), shared by the zorro run and its
# baseline twin. Both use the zorro_ppo_trainer preset (shipped in the package); the baseline adds exactly one override
# (actor_rollout_ref.actor.fsdp_config.zorro.enable=false), which makes every engine method verl's stock one.
#
# Needs: a GPU node (or a Ray cluster: `ray start --head` + `ray start --address=...` on the others), verl==0.9.1 with
# vLLM, zorro-verl installed in the same environment on every node (pip install zorro-verl[verl,flash]), and GSM8K in
# verl's parquet format (verl's examples/data_preprocess/gsm8k.py --local_save_dir $DATA_DIR).
#
# Usage: bash examples/grpo_qwen3_vllm_common.sh [extra hydra overrides...]   (called by the two wrappers)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The presets ship inside the installed package (works from a checkout's editable install too); ZORRO_CONFIGS can
# point at another folder.
CONFIGS="${ZORRO_CONFIGS:-pkg://zorro_verl.configs}"
MODEL="${MODEL:-Qwen/Qwen3-1.7B}"
DATA_DIR="${DATA_DIR:-$HOME/data/gsm8k}"
NGPUS="${NGPUS:-8}"
NNODES="${NNODES:-1}"
ROLLOUT_N="${ROLLOUT_N:-8}"
EXP="${EXP:-qwen3_grpo}"

python3 -m verl.trainer.main_ppo \
    --config-path="$CONFIGS" --config-name=zorro_ppo_trainer \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=1024 \
    data.max_response_length=2048 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n="$ROLLOUT_N" \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576 \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576 \
    trainer.critic_warmup=0 \
    trainer.logger='["console"]' \
    trainer.project_name=zorro_verl \
    trainer.experiment_name="$EXP" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.nnodes="$NNODES" \
    trainer.save_freq=-1 \
    trainer.test_freq=10 \
    trainer.total_epochs=1 \
    "$@"
