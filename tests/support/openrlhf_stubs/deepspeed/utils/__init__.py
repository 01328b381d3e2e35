def set_z3_leaf_modules(*args, **kwargs):
    raise RuntimeError("deepspeed.utils.set_z3_leaf_modules is a test stand-in (ZeRO-3 leaf modules are for MoE / "
                       "hybrid models, which the OpenRLHF tests do not load)")
