"""Importing this module installs the CPU setup of the end-to-end runs (:func:`tests.support.verl_cpu_e2e.install`).
``main_ppo`` subprocesses and their Ray actors name it in ``VERL_USE_EXTERNAL_MODULES``, imported at ``import verl``."""

from tests.support.verl_cpu_e2e import install

install()
