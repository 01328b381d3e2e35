"""Importing this module installs what a GPU run of the e2e benchmark needs besides verl's own CUDA platform
(scripts/gpu_e2e.sh --bench, named in ``VERL_USE_EXTERNAL_MODULES``): per-request rollout seeds, sequential uids,
batches in key order and the rollout record/replay of :mod:`tests.support.verl_cpu_e2e`, so that stock and zorro
train on identical rollouts. No CPU platform and no CPU stand-ins for stock's kernels (flash-attn is real there)."""

from tests.support.verl_cpu_e2e import install_ordered_batches, install_seeded_rollout

install_seeded_rollout()
install_ordered_batches()
