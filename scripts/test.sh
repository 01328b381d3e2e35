#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up .venv (see setup_env.sh), run pytest and the prefix-tree
# benchmark's CPU targets (zorro-verl bench --tree), then the verl 0.7.1
# legacy-actor tests in their own environment (.venv-verl07: verl 0.7.1 pins numpy<2), the OpenRLHF integration tests
# in theirs (.venv-openrlhf: openrlhf 0.11.2 pins transformers 5.15, see test_openrlhf.sh), the Megatron tests in
# theirs (.venv-megatron: megatron-core 0.19.2, see test_megatron.sh), the built wheel installed
# with verl in a fresh environment (.venv-wheel, see test_wheel.sh), then the end-to-end GRPO
# runs (verl main_ppo + the CPU build of vLLM, zorro vs stock) in theirs (.venv-e2e, see setup_e2e_env.sh), and the
# CI version of the e2e speed benchmark in the same environment (scripts/bench_e2e.sh --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export ZORRO_REQUIRE_VERL=1  # the verl 0.9 tests fail instead of skipping if verl is missing
# timed NAME CMD...: runs CMD (set -e stops the script if it fails) and prints how long it took.
timed() {
  local name="$1" start
  shift
  start=$(date +%s)
  "$@"
  echo "[test] $name took $(( $(date +%s) - start )) s"
}
# The prefix-tree benchmark's CPU targets (efficiency >= 0.85 where the tree's ideal is >= 2x; no more than 5%
# slower than prompt-only sharing where the tree adds nothing). Timing noise can fail one measurement on a busy
# machine: a failed run is measured once more before it counts.
tree_bench() {
  python -m zorro_verl.bench --tree --modes fwd_bwd && return 0
  echo "[test] tree benchmark: a target failed, measuring again"
  python -m zorro_verl.bench --tree --modes fwd_bwd
}
# The CI version of the e2e speed benchmark (stock vs zorro main_ppo runs, per-phase efficiency >= 0.6 of the FLOP
# model's ideal, Amdahl's floor for the whole step, worker peak RSS). Measured once more when a target is missed:
# two measured steps on a shared 2-core host can catch one slow phase.
e2e_bench() {
  bash scripts/bench_e2e.sh --quick && return 0
  echo "[test] e2e benchmark: a target was missed, measuring again"
  bash scripts/bench_e2e.sh --quick
}
timed "main suite" python -m pytest -q -p no:cacheprovider tests "$@"
timed "prefix-tree benchmark" tree_bench
timed "verl 0.7.1 suite" bash scripts/test_verl07.sh
timed "OpenRLHF suite (environment + tests)" bash scripts/test_openrlhf.sh
timed "Megatron suite (environment + tests)" bash scripts/test_megatron.sh
timed "wheel install check" bash scripts/test_wheel.sh
timed "e2e environment" bash scripts/setup_e2e_env.sh
timed "e2e main_ppo runs" .venv-e2e/bin/python -m pytest -q -s -p no:cacheprovider tests/e2e
timed "e2e benchmark (CI version)" e2e_bench
