"""Test stand-in for flash-attn (see tests/support/openrlhf_stubs/README.md): only the pure-torch padding helpers
OpenRLHF imports at module import time."""
