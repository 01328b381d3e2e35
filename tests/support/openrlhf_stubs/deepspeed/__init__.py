"""Test stand-in for DeepSpeed (see tests/support/openrlhf_stubs/README.md): OpenRLHF's model modules import it at
module import time but the tested paths call nothing of it."""

from . import utils  # noqa: F401
