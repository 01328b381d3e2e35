#!/usr/bin/env bash
# GRPO, Qwen3 + vLLM, zorro on (deduplicated actor / old-log-prob / ref forwards, group-aware DP balancing).
# Worker logs show "zorro: FSDP engine active on rank N (deduplicated forward; ...)"; metrics zorro/dedup_ratio,
# zorro/prompt_tokens_saved, zorro/split_groups, zorro/fallback_batches appear with the actor metrics.
EXP="${EXP:-qwen3_grpo_zorro}" exec bash "$(dirname "${BASH_SOURCE[0]}")/grpo_qwen3_vllm_common.sh" "$@"
