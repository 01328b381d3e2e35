"""Multi-token prediction and MoE router replay on zorro's megatron step: refused by name, with why
(docs/design/megatron.md); checked before anything runs. The engine-level refusals (``model.mtp.enable``,
``router_replay.mode``) are in tests/integrations/verl/v09/test_megatron_checks.py."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh: "
                                            ".venv-megatron)")

from tests.support import megatron_cpu as M  # noqa: E402


@pytest.fixture(scope="module")
def zorro_model(tmp_path_factory):
    warnings.filterwarnings("ignore", message="GPTModel IS DEPRECATED")
    M.init_megatron(0, 1, str(tmp_path_factory.mktemp("rdv") / "init"))
    return M.build_gpt(zorro=True)


@pytest.mark.parametrize("changes, says", [
    ({"mtp_num_layers": 1}, r"mtp_num_layers: expected 0/None with zorro, got 1: .*roll the input ids.*"
                            r"model\.mtp\.enable=False"),
    ({"num_moe_experts": 2, "moe_enable_routing_replay": True},
     r"moe_enable_routing_replay: got True .*per token of the ordinary rows.*router_replay\.mode=disabled"),
])
def test_refused_by_name(zorro_model, changes, says):
    from zorro_verl.integrations.megatron import zorro_gpt_step
    from zorro_verl.packing import build_plan

    ids, am, R = M.make_batch()
    plan = build_plan(ids, am, R)
    saved = {k: getattr(zorro_model.config, k) for k in changes}
    try:
        for k, v in changes.items():
            setattr(zorro_model.config, k, v)
        with pytest.raises(ValueError, match=says):
            zorro_gpt_step(zorro_model, plan)
    finally:
        for k, v in saved.items():
            setattr(zorro_model.config, k, v)
    zorro_gpt_step(zorro_model, plan)  # the model itself runs once the settings are back
