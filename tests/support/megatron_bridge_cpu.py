"""Megatron-Bridge 0.6.2 (verl 0.9.1's default Megatron builder, ``vanilla_mbridge=False``) on a CPU-only torch and
Python 3.11, for the Megatron engine tests (never shipped; docs/design/megatron.md "Megatron on the CPU"; ids in
brackets as in the code).

* [S1] ``typing.override`` (Python 3.12) from ``typing_extensions``: the bridge imports ``megatron.training``, whose
  ``models/hybrid.py`` uses it.
* [S2] a throw-away ``transformer_engine.pytorch`` module in ``sys.modules`` only while ``megatron.bridge`` is
  imported: ``megatron/bridge/peft/lora_layers.py`` does an unconditional ``import transformer_engine.pytorch``
  (used for ``isinstance`` checks of fused LoRA layers). Its classes can never be instantiated; it is removed again,
  so megatron-core's ``HAVE_TE`` stays False. [S2a] before it, megatron-core's TE version lookup is cached as "no TE"
  (with the stub present, ``is_te_min_version`` would look for the package's metadata and raise).
* [B1] the bridge's providers default to the Transformer Engine layer spec (``default_layer_spec``), which cannot be
  built without TE: each provider gets the bridge's own ``local_layer_spec`` (megatron's local modules), set by a wrap
  of ``AutoBridge.to_megatron_provider``; a provider whose spec is a whole decoder block (DeepSeek's:
  ``get_gpt_decoder_block_spec``, dense first layers, multi-latent attention) gets that block without TE.
* [B2] under context parallelism (``context_parallel_size > 1``) the local spec's core attention is zorro's subclass
  (``zorro_layer_spec``) of the CPU stand-in of Transformer Engine's CP attention on verl's THD path
  (:class:`tests.support.megatron_cp_stock.ThdCpCoreAttention`; megatron's local ``DotProductAttention`` has no CP
  exchange): zorro's calls run zorro's CP attention, the stock engine's (``use_remove_padding=True``) the stand-in.
* [L1] the bridge's PEFT module decides ``HAVE_TE`` from names that megatron-core defines as ``None`` without TE;
  set it False so its ``isinstance`` checks skip TE classes.

:func:`install` applies all of them once per process; :data:`AVAILABLE` says whether the bridge is installed.
"""

from __future__ import annotations

import importlib.util
import sys
import types
import typing
from functools import partial

__all__ = ["AVAILABLE", "install", "BRIDGES", "INSTALL_HINT", "installed_bridges", "results_on", "require_bridge"]

#: Whether megatron-bridge is installed here (scripts/setup_megatron_env.sh installs 0.6.2).
AVAILABLE = importlib.util.find_spec("megatron.bridge") is not None
#: The two builders of verl's Megatron engine, by the ``vanilla_mbridge`` value that selects each: Megatron-Bridge
#: (verl's default) first.
BRIDGES = {"megatron-bridge": False, "mbridge": True}
INSTALL_HINT = "bash scripts/setup_megatron_env.sh installs megatron-bridge 0.6.2 and megatron-energon"
_DONE = False


class _NeverBuilt:
    """A Transformer Engine class stand-in: nothing is ever an instance of it, and building one raises."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("transformer_engine is a CPU test stub here (tests/support/megatron_bridge_cpu.py)")


def _te_stub() -> dict:
    te = types.ModuleType("transformer_engine")
    tep = types.ModuleType("transformer_engine.pytorch")
    ops = types.ModuleType("transformer_engine.pytorch.ops")
    for name in ("Linear", "LayerNormLinear", "GroupedLinear", "LayerNorm", "RMSNorm"):
        setattr(tep, name, type(name, (_NeverBuilt,), {}))
    for name in ("Sequential", "Linear", "LayerNorm", "RMSNorm", "Dropout", "Quantize", "MakeExtraOutput",
                 "AddExtraInput", "BasicOperation", "FusibleOperation"):
        setattr(ops, name, type(name, (_NeverBuilt,), {}))
    tep.ops = ops
    te.pytorch = tep
    return {"transformer_engine": te, "transformer_engine.pytorch": tep, "transformer_engine.pytorch.ops": ops}


def installed_bridges() -> list:
    """The builders installed here, in :data:`BRIDGES` order (Megatron-Bridge, verl's default, first)."""
    return [b for b in BRIDGES if b != "megatron-bridge" or AVAILABLE]


def require_bridge() -> None:
    """In a test: skip when megatron-bridge is not installed here, or fail where ``ZORRO_REQUIRE_MEGATRON_BRIDGE=1``
    (scripts/test_megatron.sh installs it)."""
    import os

    import pytest

    if not AVAILABLE:
        if os.environ.get("ZORRO_REQUIRE_MEGATRON_BRIDGE") == "1":
            pytest.fail(f"megatron-bridge is not installed in this environment ({INSTALL_HINT})")
        pytest.skip(f"megatron-bridge (verl's default Megatron builder) is not installed here ({INSTALL_HINT})")


def results_on(all_results: list, bridge: str) -> list:
    """Each rank's results (``[{bridge: {case: ...}}]``, the rank scripts' shape) on one builder. A builder that is
    not installed skips the test, or fails it where ``ZORRO_REQUIRE_MEGATRON_BRIDGE=1`` (scripts/test_megatron.sh
    installs both)."""
    import os

    import pytest

    if bridge not in all_results[0]:
        if os.environ.get("ZORRO_REQUIRE_MEGATRON_BRIDGE") == "1":
            pytest.fail(f"{bridge} is not installed in this environment (scripts/setup_megatron_env.sh installs it)")
        pytest.skip(f"{bridge} is not installed here (scripts/setup_megatron_env.sh installs it)")
    return [res[bridge] for res in all_results]


def _import_bridge() -> None:
    import typing_extensions

    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override  # S1
    import megatron.core  # noqa: F401  (megatron-core's HAVE_TE is decided before the stub exists)
    from megatron.core.extensions import transformer_engine  # noqa: F401
    from megatron.core.utils import get_te_version

    get_te_version()  # S2a: cached while no transformer_engine module exists
    stub = _te_stub()
    saved = {k: sys.modules.get(k) for k in stub}
    sys.modules.update(stub)  # S2
    try:
        import megatron.bridge  # noqa: F401
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _local_spec_providers() -> None:
    """B1: every provider the bridge makes builds megatron's local modules: the bridge's own ``local_layer_spec``
    (one spec for every layer), or, where the bridge gives a whole decoder block (``get_gpt_decoder_block_spec``:
    DeepSeek's first dense layers, its multi-latent attention), that block built without Transformer Engine (MLA's
    core attention: P9); a hybrid block (Qwen3.5's gated delta-nets, which megatron builds on TE only) the CPU
    stand-in of tests/support/megatron_gdn.py (G1, G2)."""
    from megatron.bridge import AutoBridge
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    original = AutoBridge.to_megatron_provider

    def to_megatron_provider(self, *args, **kwargs):
        provider = original(self, *args, **kwargs)
        spec = provider.transformer_layer_spec
        if spec is get_transformer_block_with_experimental_attention_variant_spec:  # hybrid (Qwen3.5): G1 / G2
            from tests.support import megatron_gdn

            megatron_gdn.install_bridge_standins()
            provider.transformer_layer_spec = megatron_gdn.cpu_hybrid_block_spec
        elif isinstance(spec, partial) and spec.func is get_gpt_decoder_block_spec:
            kw = {k: v for k, v in spec.keywords.items() if k != "use_transformer_engine"}
            provider.transformer_layer_spec = partial(_local_block_spec, **kw)
        else:
            provider.transformer_layer_spec = _local_or_cp_spec
        return provider

    AutoBridge.to_megatron_provider = to_megatron_provider


def _local_or_cp_spec(config):
    """B1's layer spec: the bridge's ``local_layer_spec``; B2: with zorro's core attention under context parallelism."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    spec = local_layer_spec(config)
    if getattr(config, "context_parallel_size", 1) > 1:
        from tests.support.megatron_cp_stock import with_stock_cp_attention
        from zorro_verl.integrations.megatron import zorro_layer_spec

        spec = zorro_layer_spec(with_stock_cp_attention(spec))
    return spec


def _local_block_spec(config, vp_stage=None, **kw):
    """B1's decoder block: megatron's local modules, MLA's core attention taking its ``k_channels`` / ``v_channels``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from tests.support.megatron_cpu import with_mla_core_attention

    return with_mla_core_attention(get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                              vp_stage=vp_stage, **kw), config)


def install() -> None:
    """Import megatron-bridge with S1 / S2 / S2a and apply B1 / L1 (once per process; before verl's
    ``verl.models.mcore.bridge`` is imported). ``ModuleNotFoundError`` with the install line when it is missing."""
    global _DONE
    if _DONE:
        return
    if not AVAILABLE:
        raise ModuleNotFoundError(f"megatron-bridge is not installed here: {INSTALL_HINT}")
    _import_bridge()
    _local_spec_providers()
    import megatron.bridge.peft.utils as peft_utils

    peft_utils.HAVE_TE = False  # L1
    _DONE = True
