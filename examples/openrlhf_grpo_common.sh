#!/usr/bin/env bash
# GRPO with OpenRLHF 0.11.x (DeepSpeed actor + vLLM rollouts on Ray), shared by the zorro run and its baseline twin.
# The two differ only by the switch: ZORRO_OPENRLHF=1 (openrlhf_grpo_zorro.sh) or 0 (openrlhf_grpo_baseline.sh),
# passed to every Ray worker through the job's runtime env. With it on, each worker's Actor.forward (policy training,
# old log-probs, reference) runs zorro's deduplicated forward and the replay buffer / experience maker keep a
# prompt's samples together; OpenRLHF's code is not edited.
#
# Needs: GPU node(s) with a Ray cluster (`ray start --head --num-gpus 8`; `ray start --address=...` on the others),
# and on every node, in the same environment: openrlhf==0.11.2 with vLLM, zorro-verl[openrlhf,flash], and the
# loader installed once per environment (`zorro-verl openrlhf install`: a .pth file that runs at interpreter start
# and, when ZORRO_OPENRLHF is on, loads zorro at the process's first OpenRLHF import). A reward function file
# (REWARD_FN, OpenRLHF's --reward.remote_url accepts a .py path) and a prompt dataset with a label column.
#
# Usage: ZORRO_OPENRLHF=1 bash examples/openrlhf_grpo_common.sh [extra OpenRLHF args...]   (called by the wrappers)
set -euo pipefail

: "${ZORRO_OPENRLHF:?set ZORRO_OPENRLHF=1 (zorro) or 0 (baseline); use the two wrapper scripts}"
MODEL="${MODEL:-Qwen/Qwen3-1.7B}"
DATASET="${DATASET:-openai/gsm8k}"
REWARD_FN="${REWARD_FN:?a reward function file for --reward.remote_url, in the reward_func format of OpenRLHF}"
NGPUS="${NGPUS:-8}"
N="${ROLLOUT_N:-8}"
OUT="${OUT:-$HOME/openrlhf_runs/${EXP:-grpo}}"
RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
# attention_backend=auto picks the flash varlen backend on CUDA; on_unsupported=raise stops at the first call zorro
# cannot run exactly (ring attention, tensor parallelism, VLM, LoRA, MoE aux loss) instead of training another way.
OPTIONS="${ZORRO_OPENRLHF_OPTIONS:-attention_backend=auto,on_unsupported=raise,rollout_n=$N}"

RUNTIME_ENV="{\"env_vars\": {\"ZORRO_OPENRLHF\": \"$ZORRO_OPENRLHF\", \"ZORRO_OPENRLHF_OPTIONS\": \"$OPTIONS\"}}"
if [ "$ZORRO_OPENRLHF" = 1 ]; then
  # the loader here, and what a worker of this job loads on every node of the cluster (exit 1 if zorro is not on)
  zorro-verl openrlhf status --address auto --runtime-env-json "$RUNTIME_ENV"
fi

# Micro-batch sizes are multiples of n: experience-making micro-batches then hold whole groups (zorro warns and counts
# otherwise). Training keeps OpenRLHF's optimizer steps (4 per rollout here) and groups samples only inside each step;
# add group_balance_mode=whole_groups to the options to pack whole groups instead (other samples then share a step).
ray job submit --address="$RAY_ADDRESS" \
  --runtime-env-json="$RUNTIME_ENV" \
  -- python3 -m openrlhf.cli.train_ppo_ray \
  --ref.num_nodes 1 --ref.num_gpus_per_node "$NGPUS" \
  --actor.num_nodes 1 --actor.num_gpus_per_node "$NGPUS" \
  --vllm.num_engines "$NGPUS" --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.5 \
  --train.colocate_all --vllm.enable_sleep --ds.enable_sleep \
  --actor.model_name_or_path "$MODEL" \
  --reward.remote_url "$REWARD_FN" \
  --data.prompt_dataset "$DATASET" --data.input_key question --data.label_key answer --data.apply_chat_template \
  --algo.advantage.estimator group_norm \
  --rollout.n_samples_per_prompt "$N" \
  --rollout.batch_size 128 --rollout.micro_batch_size "$((2 * N))" \
  --train.batch_size 256 --train.micro_batch_size "$N" \
  --data.max_len 4096 --rollout.max_new_tokens 2048 \
  --algo.kl.use_loss --algo.kl.init_coef 0.001 --algo.kl.estimator k3 \
  --ds.zero_stage 3 --ds.param_dtype bf16 --ds.packing_samples --ds.attn_implementation flash_attention_2 \
  --actor.gradient_checkpointing_enable --actor.adam.lr 1e-6 \
  --train.max_epochs 1 --train.num_episodes 1 \
  --ckpt.output_dir "$OUT" \
  "$@"
