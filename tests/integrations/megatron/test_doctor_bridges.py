"""``zorro-verl doctor`` in the Megatron environment (both of verl's model builders installed): the bridge line names
the one the composed config selects, with its version (the main environment's test_doctor.py checks the failing
side: a missing builder, with its install line)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh)")


def _checks(overrides):
    from zorro_verl.doctor import run_checks

    return {c.name: c for c in run_checks(overrides, torch.device("cpu"), check_plugin=False,
                                          config_name="zorro_megatron_trainer")}


@pytest.mark.parametrize("vanilla, words", [(False, "Megatron-Bridge 0.6.2"), (True, "mbridge 0.15.1")])
def test_doctor_names_the_selected_bridge(vanilla, words):
    import importlib.util

    if not vanilla and importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("megatron-bridge is not installed here (scripts/setup_megatron_env.sh installs it)")
    overrides = [f"actor_rollout_ref.{r}.megatron.vanilla_mbridge={str(vanilla).lower()}" for r in ("actor", "ref")]
    checks = _checks(overrides)
    assert checks["megatron-core"].status == "ok" and "0.19.2" in checks["megatron-core"].detail
    bridge = checks["megatron bridge"]
    assert bridge.status == "ok" and words in bridge.detail and "actor and ref" in bridge.detail, bridge
    assert checks["zorro (actor)"].status == "ok", checks["zorro (actor)"]
