"""Importing this module installs the verl CPU platform (:mod:`tests.support.verl_cpu_platform`). Ray workers and
subprocesses name it in ``VERL_USE_EXTERNAL_MODULES``, which verl imports first at ``import verl``."""

from tests.support.verl_cpu_platform import use_cpu_platform

use_cpu_platform()
