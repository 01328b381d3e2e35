"""FSDP1 (verl's ``strategy: fsdp``) on the CPU test platform (tests and CI only; it does not ship with the package).

Two things in torch's FSDP1 need an accelerator where verl's engine uses them, and :func:`allow_cpu_fsdp1` adapts
exactly those two, so verl's own code path runs otherwise unchanged:

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
  ``CPUOffload(offload_params=False)``.

Installed with the CPU platform (:func:`tests.support.verl_cpu_platform.use_cpu_platform`, which the engine tests,
their rank processes and Ray workers call) and by the end-to-end CPU setup (:func:`tests.support.verl_cpu_e2e
.install`); both refuse to run when CUDA is available.
"""

from __future__ import annotations

__all__ = ["allow_cpu_fsdp1"]


def allow_cpu_fsdp1() -> None:
    """Let FSDP1's ``sync_module_states=True`` broadcast CPU tensors and run ``CPUOffload(offload_params=True)``
    wrappers without offloading (idempotent)."""
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
