"""Importing this module installs only the reproducible-rollout patch
(:func:`tests.support.verl_cpu_e2e.install_seeded_rollout`): for GPU end-to-end runs (scripts/gpu_e2e.sh), named in
``VERL_USE_EXTERNAL_MODULES``."""

from tests.support.verl_cpu_e2e import install_seeded_rollout

install_seeded_rollout()
