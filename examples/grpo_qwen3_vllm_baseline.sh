#!/usr/bin/env bash
# The baseline twin of grpo_qwen3_vllm_zorro.sh: identical, plus the one override that switches zorro off
# (the ref config follows the actor's `enable` through an interpolation; with enable=false every engine method and
# the trainer's balancing are verl's stock ones).
EXP="${EXP:-qwen3_grpo_baseline}" exec bash "$(dirname "${BASH_SOURCE[0]}")/grpo_qwen3_vllm_common.sh" \
    actor_rollout_ref.actor.fsdp_config.zorro.enable=false "$@"
