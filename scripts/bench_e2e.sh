#!/usr/bin/env bash
# The speed-up of a real GRPO step, phase by phase: verl's `python -m verl.trainer.main_ppo` on this machine's CPU
# (CPU build of vLLM for rollouts, one FSDP1 training worker), stock vs zorro (sharing=prompt) vs zorro
# (sharing=prefix) on identical recorded rollouts, 1 warm-up + 4 measured steps. Prints verl's timing_s/* medians
# per phase against the FLOP model's ideal, the peak RSS per process role, and checks the targets (exit 1 when one
# is missed). See tests/e2e/bench.py and docs/BENCHMARKS.md ("A real GRPO step").
#   bash scripts/bench_e2e.sh                # the full run (~10 min on 2 cores)
#   bash scripts/bench_e2e.sh --docs         # ... and write the table and plot into docs/BENCHMARKS.md
#   bash scripts/bench_e2e.sh --quick        # the CI version (stock and zorro with sharing=prompt, 1 warm-up + 2
#                                            # measured steps, efficiency >= 0.6)
# Sets up .venv-e2e first (scripts/setup_e2e_env.sh: reused when up to date). Work dir: --out DIR (default: a new
# temporary directory, printed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_e2e_env.sh
exec .venv-e2e/bin/python -m tests.e2e.bench "$@"
