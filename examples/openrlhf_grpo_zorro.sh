#!/usr/bin/env bash
# OpenRLHF GRPO with zorro on: the deduplicated actor / old-log-prob / reference forwards and group-aware batching.
# Worker logs show "zorro: OpenRLHF actor forward active (deduplicated forward; backend=..., ...)"; the step metrics
# OpenRLHF logs gain zorro/dedup_ratio, zorro/prompt_tokens_saved, zorro/split_groups and zorro/fallback_batches
# (the policy, summed over its ranks), zorro/ref_* (the reference model) and zorro/experience_split_groups.
EXP="${EXP:-openrlhf_grpo_zorro}" ZORRO_OPENRLHF=1 exec bash "$(dirname "${BASH_SOURCE[0]}")/openrlhf_grpo_common.sh" "$@"
