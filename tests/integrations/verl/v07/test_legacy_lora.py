"""LoRA (PEFT) in verl 0.7.1's legacy actor: ZoRRoDataParallelPPOActor vs the stock DataParallelPPOActor on the same
``PeftModel`` (CPU, fp32, one gloo process), as verl 0.7's worker builds it for ``model.lora_rank > 0``.

The adapter's ``lora_B`` is drawn at random (tests/support/lora.py) so that it changes the outputs and ``lora_A`` has
gradients. Checked: ``compute_log_prob`` with the adapter, and with it disabled (verl 0.7's reference for LoRA: the
actor under ``disable_adapter()``, equal to the base model), and ``update_policy`` (losses, grad norms, every
parameter after the SGD step: the LoRA weights moved equally, the base weights not at all), on ``all-linear`` and a
subset of projections, fixed and dynamic batch size, sharing prompt and prefix, plain and FSDP2-wrapped. Refused:
LoRA dropout > 0. Tolerances as the legacy-actor suite: 1e-5 (max abs on log-probs / entropy / parameters, losses,
grad norms).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.integrations.verl.v07.conftest import ZORRO_ON, make_actor_config, make_batch
from tests.support.lora import LORA_TARGETS, wrap_lora

TOL = 1e-5
LOSS_KEYS = ("actor/pg_loss", "actor/kl_loss")


def _classes():
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    from zorro_verl.integrations.verl.v07.actor import ZoRRoDataParallelPPOActor

    return DataParallelPPOActor, ZoRRoDataParallelPPOActor


def _fsdp2(model):
    """``model`` (a PeftModel) sharded as verl 0.7.1's worker does for ``strategy=fsdp2`` (``apply_fsdp2``: each
    decoder layer, then the root), on a 1-rank CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from verl.utils.fsdp_utils import apply_fsdp2

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)
    layer = type(model.get_base_model().model.layers[0]).__name__
    apply_fsdp2(model, {"mesh": mesh, "mp_policy": mp, "offload_policy": None, "reshard_after_forward": True},
                {"wrap_policy": {"transformer_layer_cls_to_wrap": [layer]}})
    return model


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _lora_pair(base_model, target="all-linear", *, fsdp2=False, zorro=ZORRO_ON, dropout=0.0, **cfg):
    """(stock, zorro) actors, each on its own copy of ``base_model`` with the same LoRA adapter; SGD (lr 1) over
    the trainable (LoRA) parameters."""
    Stock, Zorro = _classes()
    actors = []
    for cls, zcfg in ((Stock, None), (Zorro, zorro)):
        m = wrap_lora(copy.deepcopy(base_model), LORA_TARGETS[target], seed=1, dropout=dropout)
        if fsdp2:
            m = _fsdp2(m)
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1.0)
        actors.append(cls(config=make_actor_config(zorro=zcfg, **cfg), actor_module=m, actor_optimizer=opt))
    actors[0]._initial = {n: _full(p).detach().clone() for n, p in actors[0].actor_module.named_parameters()}
    return actors


def _max_abs(a, b, mask):
    return (a - b)[mask].abs().max().item()


@pytest.mark.parametrize("use_dynamic_bsz", [False, True], ids=["fixed", "dynamic"])
@pytest.mark.parametrize("target", list(LORA_TARGETS))
def test_lora_log_probs_and_reference(base_model, target, use_dynamic_bsz):
    stock, zorro = _lora_pair(base_model, target, use_dynamic_bsz=use_dynamic_bsz)
    data = make_batch(use_dynamic_bsz=use_dynamic_bsz, micro=3, max_token_len=48)
    mask = data.batch["response_mask"].bool()
    a = stock.compute_log_prob(data, calculate_entropy=True)
    b = zorro.compute_log_prob(data, calculate_entropy=True)
    assert _max_abs(a["log_probs"], b["log_probs"], mask) <= TOL
    assert _max_abs(a["entropys"], b["entropys"], mask) <= TOL
    m = zorro.zorro_metrics()
    assert m["zorro/dedup_ratio"] > 1.3 and m["zorro/fallback_batches"] == 0
    # the reference: verl 0.7's worker runs the actor under disable_adapter() (no entropy)
    with stock.actor_module.disable_adapter():
        ra = stock.compute_log_prob(data, calculate_entropy=False)
    with zorro.actor_module.disable_adapter():
        rb = zorro.compute_log_prob(data, calculate_entropy=False)
    assert _max_abs(ra["log_probs"], rb["log_probs"], mask) <= TOL
    assert _max_abs(a["log_probs"], ra["log_probs"], mask) > 1e-3  # the adapter matters
    Stock, _ = _classes()
    plain = Stock(config=make_actor_config(), actor_module=copy.deepcopy(base_model), actor_optimizer=None)
    assert _max_abs(plain.compute_log_prob(data, calculate_entropy=False)["log_probs"], rb["log_probs"], mask) <= TOL


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
@pytest.mark.parametrize("use_dynamic_bsz", [False, True], ids=["fixed", "dynamic"])
@pytest.mark.parametrize("fsdp2", [False, True], ids=["plain", "fsdp2"])
def test_lora_update_policy(base_model, fsdp2, use_dynamic_bsz, sharing):
    zorro_cfg = {**ZORRO_ON, "sharing": sharing, "min_shared_len": 4}
    stock, zorro = _lora_pair(base_model, fsdp2=fsdp2, zorro=zorro_cfg, use_dynamic_bsz=use_dynamic_bsz,
                              loss_agg_mode="seq-mean-token-mean", max_token_len=48)
    data = make_batch(allow_empty=False)
    ms, mz = stock.update_policy(data), zorro.update_policy(data)
    for k in LOSS_KEYS:
        assert abs(ms[k] - mz[k]) <= TOL, (k, ms[k], mz[k])
    assert len(ms["actor/grad_norm"]) == len(mz["actor/grad_norm"]) >= 1
    for a, b in zip(ms["actor/grad_norm"], mz["actor/grad_norm"]):
        assert a > 1e-4 and abs(a - b) <= TOL * max(1.0, abs(a))
    assert mz["zorro/dedup_ratio"] > 1.3 and mz["zorro/fallback_batches"] == 0
    after = {n: _full(p).detach() for n, p in zorro.actor_module.named_parameters()}
    ref = {n: _full(p).detach() for n, p in stock.actor_module.named_parameters()}
    moved = {n: (ref[n] - stock._initial[n]).abs().max().item() for n in ref}
    lora = [n for n in ref if "lora_" in n]
    # every LoRA weight (lora_A and lora_B) trained, the step large against the tolerance
    assert len(lora) >= 4 and all(moved[n] > 0 for n in lora) and max(moved[n] for n in lora) > 100 * TOL
    assert all(moved[n] == 0 for n in ref if "lora_" not in n)  # the base weights are frozen
    assert max((ref[n] - after[n]).abs().max().item() for n in ref) <= TOL


def test_lora_dropout_is_refused(base_model):
    _, Zorro = _classes()
    m = wrap_lora(copy.deepcopy(base_model), dropout=0.1)
    with pytest.raises(ValueError, match=r"LoRA dropout > 0 .*p=0.1"):
        Zorro(config=make_actor_config(zorro=ZORRO_ON), actor_module=m, actor_optimizer=None)
