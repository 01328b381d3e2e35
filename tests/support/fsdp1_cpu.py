"""FSDP1 (verl's ``strategy: fsdp``) on the CPU test platform (tests and CI only; it does not ship with the package).

Three things in torch's FSDP1 and verl's use of it need an accelerator, and :func:`allow_cpu_fsdp1` adapts exactly
those, so verl's own code path runs otherwise unchanged:

* verl builds the wrapper with ``sync_module_states=True``: only rank 0 loads the checkpoint (an untied model is
  built on the meta device elsewhere and materialised empty by verl's ``param_init_fn``), and FSDP1 broadcasts rank
  0's parameters and buffers to the others. torch refuses that broadcast for CPU tensors before trying it ("The
  module has CPU parameters or buffers when ``sync_module_states=True``, which requires them to be on GPU"),
  although gloo broadcasts CPU tensors. Only that refusal is removed: the broadcast happens. (Turning
  ``sync_module_states`` off instead would leave ranks other than 0 with the uninitialised memory ``to_empty``
  gives; measured: NaN losses with 2 ranks.)
* verl builds a forward-only engine (the reference model) with ``CPUOffload(offload_params=True)``, whose parameter
  shards FSDP1 pins in host memory, which needs an accelerator ("Cannot access accelerator device when none is
  available"). On a CPU-only host the parameters live on the CPU anyway: the wrapper gets
  ``CPUOffload(offload_params=False)``;
* verl's ``load_fsdp_model_to_gpu`` (before it exports the weights for the rollout's weight sync, and around
  checkpoints) moves FSDP1's flat parameters to ``torch.device(f"{device_name}:{device_id}")``, which is
  ``"cpu:cpu"`` on the CPU platform ("Invalid device string"). It gets the same steps with ``torch.device("cpu")``.

Installed with the CPU platform (:func:`tests.support.verl_cpu_platform.use_cpu_platform`, which the engine tests,
their rank processes and Ray workers call) and by the end-to-end CPU setup (:func:`tests.support.verl_cpu_e2e
.install`); both refuse to run when CUDA is available.
"""

from __future__ import annotations

__all__ = ["allow_cpu_fsdp1"]


def allow_cpu_fsdp1() -> None:
    """Let FSDP1's ``sync_module_states=True`` broadcast CPU tensors, run ``CPUOffload(offload_params=True)``
    wrappers without offloading and verl's ``load_fsdp_model_to_gpu`` move FSDP1 parameters to the CPU
    (idempotent)."""
    import inspect

    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, _init_utils

    if getattr(FullyShardedDataParallel.__init__, "_zorro_cpu_fsdp1", False):
        return

    def accept_cpu_states(module_states) -> None:
        # torch's check refuses CPU tensors; the broadcast that follows it runs over gloo on CPU
        return None

    _init_utils._check_module_states_for_sync_module_states = accept_cpu_states

    orig = FullyShardedDataParallel.__init__
    sig = inspect.signature(orig)

    def __init__(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        offload = bound.arguments.get("cpu_offload")
        if offload is not None and offload.offload_params:
            bound.arguments["cpu_offload"] = CPUOffload(offload_params=False)  # pinning needs an accelerator
        return orig(*bound.args, **bound.kwargs)

    __init__._zorro_cpu_fsdp1 = True
    FullyShardedDataParallel.__init__ = __init__
    _patch_load_to_device()


def _patch_load_to_device() -> None:
    """verl's ``load_fsdp_model_to_gpu`` for FSDP1 with the CPU as the device (FSDP2 models: verl's own), in
    ``verl.utils.fsdp_utils`` and in its FSDP engine module if that already bound the name."""
    import sys

    import torch
    from torch.distributed.fsdp._runtime_utils import _lazy_init
    from verl.utils import fsdp_utils

    orig = fsdp_utils.load_fsdp_model_to_gpu

    def load_fsdp_model_to_gpu(model) -> None:
        if fsdp_utils.fsdp_version(model) != 1:
            return orig(model)
        _lazy_init(model, model)
        assert model._is_root, "Only support root model loading to GPU"
        for handle in model._all_handles:
            if handle._offload_params:
                continue
            handle.flat_param_to(torch.device("cpu"), non_blocking=True)
            handle.flat_param._local_shard = handle.flat_param.data

    for name in ("verl.utils.fsdp_utils", "verl.workers.engine.fsdp.transformer_impl"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "load_fsdp_model_to_gpu", None) is orig:
            module.load_fsdp_model_to_gpu = load_fsdp_model_to_gpu
