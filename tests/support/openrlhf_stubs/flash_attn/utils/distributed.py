"""Test stand-in: flash-attn's ``all_gather`` is used by OpenRLHF only under ring attention (not run on CPU)."""


def all_gather(*args, **kwargs):
    raise RuntimeError("flash_attn.utils.distributed.all_gather is a test stand-in (ring attention is not tested)")
