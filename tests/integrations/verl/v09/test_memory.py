"""logits_optimization=memory in the verl 0.9 engine (fp32, 1-rank gloo, the untied lm_head as its own FSDP unit: under
FSDP2 verl wraps it so, under FSDP1 a size-based wrap policy does): training steps equal the stock engine's, the head
is gathered once per step whatever the chunk count, and static refusals happen at initialisation. The head's own
FSDP1 unit runs its wrapper's forward (which gathers the head) around zorro's head function; before, the memory mode
refused such a head at engine start ("expected a torch.nn.Linear head, got FullyShardedDataParallel").

Tolerances (docs/design/testing.md): log-probs / entropy max abs <= 1e-5; loss, grad norm, gradients relative <= 1e-5.
"""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5


def _batch(**kw):
    from tests.support.verl_engines import make_engine_batch

    args = dict(batch_size=12, num_prompts=3, prompt_len=7, response_len=6, seed=11, shuffle=True, temperature=0.9,
                calculate_entropy=True, micro_batch_size=4, max_token_len=40)
    args.update(kw)
    return make_engine_batch(**args)


def _head_is_own_fsdp_unit(engine) -> bool:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    head = engine.module.get_output_embeddings()
    return isinstance(head, (FSDPModule, FullyShardedDataParallel)) and head is not engine.module


def _head_unit(ckpt, strategy) -> dict:
    """``build_engine`` keywords that make the head its own FSDP unit under ``strategy``."""
    from tests.support.verl_engines import head_unit_policy

    return {"strategy": strategy, "engine_overrides": head_unit_policy(ckpt) if strategy == "fsdp" else None}


@pytest.mark.parametrize("dynamic", [False, True])
def test_memory_mode_training_step_matches_stock(verl_cpu, tiny_ckpt, strategy, dynamic):
    """Chunks of 4 rows (several per micro-batch): loss, grad norm and every gradient equal the stock engine's."""
    from tests.support.verl_engines import build_engine, engine_grads, ppo_loss_fn
    from zorro_verl.testing import grad_rel_error

    td = _batch(use_dynamic_bsz=dynamic)
    outs, grads = [], []
    for z in (False, True):
        eng = build_engine(tiny_ckpt, zorro=z, use_dynamic_bsz=dynamic, micro_batch_size=4, max_token_len=40,
                           zorro_settings={"logits_optimization": "memory"}, **_head_unit(tiny_ckpt, strategy))
        if z:
            assert _head_is_own_fsdp_unit(eng)
            eng.logits_chunk_size = 4
        with eng.train_mode(zero_grad_on_exit=False):  # keep the grads for the comparison
            outs.append(eng.train_batch(td.clone(), loss_function=ppo_loss_fn()))
        grads.append(engine_grads(eng))
    a, b = outs
    assert b["metrics"]["zorro/fallback_batches"] == [0.0]
    loss_a, loss_b = sum(a["loss"]), sum(b["loss"])
    gn_a, gn_b = float(a["metrics"]["grad_norm"]), float(b["metrics"]["grad_norm"])
    assert abs(loss_a) > 1e-4 and gn_a > 1e-4
    assert abs(loss_a - loss_b) <= RTOL * abs(loss_a)
    assert abs(gn_a - gn_b) <= RTOL * gn_a
    assert any("lm_head" in k for k in grads[1])
    assert grad_rel_error(grads[0], grads[1]) <= RTOL


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_memory_mode_gathers_the_head_once_per_step(verl_cpu, tiny_ckpt, monkeypatch, strategy, sharing):
    """FSDP unshards (all-gathers) the head's parameters as often per micro-batch with 4-row chunks as with one
    chunk and as the stock engine, in inference and in training: the chunk loop never calls the head module. Also
    for prefix-tree plans (``sharing=prefix``: the head on the distinct predicting positions). Counted on the head's
    FSDP2 parameter group, or on its FSDP1 unit's flat-parameter handle."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from tests.support.verl_engines import build_engine, ppo_loss_fn

    unit = _head_unit(tiny_ckpt, strategy)
    engines = {"stock": build_engine(tiny_ckpt, zorro=False, micro_batch_size=4, **unit),
               "zorro": build_engine(tiny_ckpt, zorro=True, micro_batch_size=4,
                                     zorro_settings={"logits_optimization": "memory", "sharing": sharing,
                                                     "min_shared_len": 4}, **unit)}
    assert all(_head_is_own_fsdp_unit(e) for e in engines.values())
    if strategy == "fsdp":
        cls = FlatParamHandle
        groups = {name: e.module.get_output_embeddings()._handle for name, e in engines.items()}
    else:
        cls = FSDPParamGroup
        groups = {name: e.module.get_output_embeddings()._get_fsdp_state()._fsdp_param_group
                  for name, e in engines.items()}
    counts = {}
    orig = cls.unshard

    def counting(self, *a, **k):
        for name, g in groups.items():
            if self is g:
                counts[name] = counts.get(name, 0) + 1
        return orig(self, *a, **k)

    monkeypatch.setattr(cls, "unshard", counting)
    td = _batch()

    def per_micro_batch(name, chunk=None):
        eng = engines[name]
        if chunk is not None:
            eng.logits_chunk_size = chunk
        counts.clear()
        with eng.eval_mode():
            inf = eng.infer_batch(td.clone(), loss_function=None)
        n_inf = counts.get(name, 0)
        counts.clear()
        with eng.train_mode():
            eng.train_batch(td.clone(), loss_function=ppo_loss_fn())
        if name == "zorro":
            assert inf["metrics"]["zorro/fallback_batches"] == [0.0]
            assert len(eng.zorro_last_micro_batches) == 3
            assert ("zorro/tree_depth" in inf["metrics"]) == (sharing == "prefix")  # tree plans ran
        return n_inf / 3, counts.get(name, 0) / 3  # 12 rows, 4 per micro-batch, groups of 4: 3 micro-batches

    stock = per_micro_batch("stock")
    assert stock[0] >= 1 and stock[1] >= 2
    # 12 rows x up to 6 response tokens: every micro-batch has more response rows than one 4-row chunk
    assert per_micro_batch("zorro", 4) == per_micro_batch("zorro", 10_000) == stock


def test_memory_mode_refused_at_initialisation(verl_cpu, tmp_path):
    """A model that soft-caps its logits after the head cannot run the memory mode: refused when the engine is
    built, not at the first step."""
    from tests.support.verl_engines import build_engine
    from zorro_verl.testing import tiny_model

    model = tiny_model("qwen3", dtype=torch.float32, seed=0)
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.config.final_logit_softcapping = 30.0
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        build_engine(str(tmp_path), zorro=True, zorro_settings={"logits_optimization": "memory"})
