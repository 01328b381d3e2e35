"""Import OpenRLHF's Ray-side actor trainer module (``openrlhf.trainer.ray.ppo_actor``, which imports
``.launcher``) in a CPU test environment.

Its module-level imports reach code these tests never call, whose packages the test environment lacks: the vLLM
engines (``openrlhf.trainer.ray.vllm_engine``: vLLM is GPU only), the VLM helpers (``openrlhf.utils.vlm_utils``:
PIL), torchdata's ``StatefulDataLoader`` (the prompt loader) and, where DeepSpeed is absent or only its pure-torch
helpers are stood in, ``deepspeed.runtime.zero.partition_parameters.ZeroParamStatus`` (ZeRO-3 offload utilities).
For each such module that cannot be imported, :func:`import_ppo_actor` puts an empty stand-in holding the imported
names in ``sys.modules``; everything a test then calls (``ActorPPOTrainer.ppo_train``, ``training_step``, the replay
buffer, the loss, ``BaseModelActor.execute_batch``) is OpenRLHF's real code. An importable module is never
replaced.
"""

from __future__ import annotations

import importlib
import sys
import types

#: module -> names imported from it at import time by the trainer modules.
_IMPORT_ONLY = {
    "openrlhf.trainer.ray.vllm_engine": ("batch_vllm_engine_call", "create_vllm_engines"),
    "openrlhf.utils.vlm_utils": ("merge_mm_train_inputs",),
    "torchdata": (),
    "torchdata.stateful_dataloader": ("StatefulDataLoader",),
    "deepspeed.runtime": (),
    "deepspeed.runtime.zero": (),
    "deepspeed.runtime.zero.partition_parameters": ("ZeroParamStatus",),
}


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def import_ppo_actor():
    """``(ppo_actor, launcher)``: OpenRLHF's modules, with import-only stand-ins for what cannot be imported."""
    for name, attrs in _IMPORT_ONLY.items():
        if name in sys.modules or _importable(name):
            continue
        mod = types.ModuleType(name)
        mod.__path__ = []  # a package, so its stand-in children import
        mod.__zorro_test_stand_in__ = True
        for attr in attrs:
            setattr(mod, attr, type(attr, (), {}))
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, mod)
    return importlib.import_module("openrlhf.trainer.ray.ppo_actor"), importlib.import_module(
        "openrlhf.trainer.ray.launcher")
