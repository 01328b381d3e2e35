#!/usr/bin/env bash
# GRPO on verl 0.7.x's legacy workers (ray_trainer + fsdp_workers) with zorro's deduplicated actor and ref forward.
# Needs what any verl 0.7 GRPO run needs (GPUs, a rollout engine, a model, parquet data); zorro adds one package:
#   pip install zorro-verl --no-deps      (into verl 0.7's environment; or pip install -e /path/to/checkout --no-deps)
# Everything after the script name is passed on as Hydra overrides.
set -euo pipefail
CONFIGS="${ZORRO_CONFIGS:-pkg://zorro_verl.configs}"  # the presets ship inside the installed package
N="${ROLLOUT_N:-8}"

# Loads the plugin at `import verl` in every process (the preset's actor_rollout_ref.model.external_lib does the
# same inside the FSDP workers; either one is enough).
export VERL_USE_EXTERNAL_MODULES=zorro_verl.integrations.verl.v07.plugin

# Micro-batches hold whole groups when ppo_micro_batch_size_per_gpu is a multiple of rollout.n (fixed size) or with
# use_dynamic_bsz (the token budget then counts each prompt once). With more than one GPU, trainer.balance_batch=true
# (verl's default) spreads a prompt's responses over ranks, which lowers zorro/dedup_ratio; false keeps verl's
# contiguous groups on one rank when the per-rank batch is a multiple of rollout.n.
python3 -m verl.trainer.main_ppo --config-path="$CONFIGS" --config-name=zorro_legacy \
  algorithm.adv_estimator=grpo \
  actor_rollout_ref.rollout.n="$N" \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$N" \
  actor_rollout_ref.actor.use_kl_loss=true \
  actor_rollout_ref.model.use_remove_padding=true \
  "$@"
