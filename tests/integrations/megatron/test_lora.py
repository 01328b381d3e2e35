"""verl's Megatron LoRA (Megatron-Bridge PEFT) under zorro at the model level, fp64 on CPU (docs/design/testing.md).

The engine tests compare LoRA in fp32 (test_engine.py, test_matrix.py), where the adapters' gradients carry the
most rounding of any parameter (measured: up to ~1e-5 relative at TP = 1 x PP = 2, against 3e-7 between two stock
engines that only split the micro-batches differently). This is the exactness check that fp32 cannot give:
Megatron-Bridge's ``LoRA`` transform (rank 4, every linear layer, B initialised like A so the adapters act) on the
tiny fp64 ``GPTModel`` of tests/support/megatron_cpu.py, zorro's step vs megatron's ordinary forward on the same
weights: log-probs / entropy <= 1e-12 absolute, every adapter gradient <= 1e-12 relative to its largest entry
(test_gpt_step.py's rules), prompt and prefix-tree sharing.
"""

from __future__ import annotations

import os
import warnings

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here (run scripts/test_megatron.sh: "
                                            ".venv-megatron)")

import torch  # noqa: E402

from tests.support import megatron_bridge_cpu  # noqa: E402
from tests.support import megatron_cpu as M  # noqa: E402

TOL_VALUE = 1e-12
TOL_GRAD = 1e-12
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


@pytest.fixture(scope="module")
def lora_cls(tmp_path_factory):
    if not megatron_bridge_cpu.AVAILABLE:
        if os.environ.get("ZORRO_REQUIRE_MEGATRON_BRIDGE") == "1":
            pytest.fail(f"megatron-bridge is not installed here: {megatron_bridge_cpu.INSTALL_HINT}")
        pytest.skip("megatron-bridge is not installed here")
    warnings.filterwarnings("ignore", message="GPTModel IS DEPRECATED")
    M.init_megatron(0, 1, str(tmp_path_factory.mktemp("rdv") / "init"))
    megatron_bridge_cpu.install()
    from megatron.bridge.peft.lora import LoRA

    return LoRA


def _with_lora(lora_cls, model):
    torch.manual_seed(5)  # the adapters' initialisation (copied onto the zorro model anyway)
    return lora_cls(target_modules=TARGETS, dim=4, alpha=16, dropout=0.0, lora_B_init_method="xavier")(model,
                                                                                                         training=True)


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_lora_exact_fp64(lora_cls, sharing):
    stock = _with_lora(lora_cls, M.build_gpt(zorro=False, parallel_output=False))
    zorro = _with_lora(lora_cls, M.build_gpt(zorro=True))
    ref = dict(stock.named_parameters())
    with torch.no_grad():  # the same base weights and adapters
        for name, p in zorro.named_parameters():
            p.copy_(ref[name])
    assert type(zorro.decoder.layers[0].self_attention.linear_qkv).__name__ == "LoRALinear"
    ids, am, R = M.make_batch(shared_prefix=sharing == "prefix")
    s = M.stock_outputs(stock, ids, am, R)
    lp, ent, plan = M.zorro_outputs(zorro, ids, am, R, sharing=sharing)
    assert plan.T < plan.ordinary_tokens  # the prompts really were shared
    gs = {n: p.grad.detach().clone() for n, p in stock.named_parameters() if p.requires_grad}
    gz = {n: p.grad.detach().clone() for n, p in zorro.named_parameters() if p.requires_grad}
    # A and B of every target in both layers train, the base is frozen
    assert len(gs) == 2 * 2 * len(TARGETS) and all("adapter" in n for n in gs), sorted(gs)
    assert min(g.abs().max().item() for g in gs.values()) > 0
    res = M.compare(s, (lp, ent), gs, gz)
    print(f"LoRA fp64 ({sharing}): {res}")
    assert res["logprob"] <= TOL_VALUE and res["entropy"] <= TOL_VALUE, res
    assert res["grad_rel"] <= TOL_GRAD, res
