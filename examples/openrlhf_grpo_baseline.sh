#!/usr/bin/env bash
# The baseline twin of openrlhf_grpo_zorro.sh: identical except the switch, ZORRO_OPENRLHF=0 (no zorro module is
# imported in any process; OpenRLHF runs exactly as shipped).
EXP="${EXP:-openrlhf_grpo_baseline}" ZORRO_OPENRLHF=0 exec bash "$(dirname "${BASH_SOURCE[0]}")/openrlhf_grpo_common.sh" "$@"
