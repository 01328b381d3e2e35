"""The zorro FSDP engine vs verl 0.9.1's stock FSDPEngineWithLMHead on CPU (fp32, 1-rank gloo), under FSDP2 and
FSDP1 (the ``strategy`` fixture: every engine test here runs under both).

Tolerances (docs/design/testing.md): log-probs / entropy max abs <= 1e-5; PPO loss, grad norm and every gradient
relative <= 1e-5 (fp32).
"""

import logging

import pytest
import torch

from tests.support.verl_engines import infer, output_values

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5


@pytest.fixture(scope="module")
def engines(verl_cpu, tiny_ckpt, strategy):
    from tests.support.verl_engines import build_engine

    return build_engine(tiny_ckpt, zorro=False, strategy=strategy), build_engine(tiny_ckpt, zorro=True,
                                                                                 strategy=strategy)


@pytest.mark.parametrize("dynamic, rmpad, temperature, entropy", [
    (False, True, 1.0, True),
    (False, False, 0.7, True),
    (True, True, 0.7, False),
    (True, False, 1.3, True),
])
def test_infer_matches_stock(engines, dynamic, rmpad, temperature, entropy):
    from tests.support.verl_engines import make_engine_batch

    stock, zorro = engines
    # 3 prompts over 12 shuffled rows (interleaved siblings), uneven prompt/response lengths, a 1-token and an empty
    # response; micro-batch size 3 / token budget 40 force splits and several micro-batches.
    td = make_engine_batch(batch_size=12, num_prompts=3, prompt_len=7, response_len=6, seed=3, shuffle=True,
                           temperature=temperature, calculate_entropy=entropy, use_dynamic_bsz=dynamic,
                           micro_batch_size=3, max_token_len=40, use_remove_padding=rmpad)
    a, b = infer(stock, td), infer(zorro, td)
    mask = td["response_mask"].bool()
    lp_a, lp_b = output_values(a, td, "log_probs"), output_values(b, td, "log_probs")
    assert mask.sum() > 20 and lp_a[mask].abs().max() > 1.0  # a real comparison, not zeros
    assert (lp_a - lp_b)[mask].abs().max().item() <= ATOL
    if entropy:
        ea, eb = output_values(a, td, "entropy"), output_values(b, td, "entropy")
        assert (ea - eb)[mask].abs().max().item() <= ATOL
    else:
        assert "entropy" not in b["model_output"]
    m = b["metrics"]
    assert m["zorro/fallback_batches"] == [0.0]
    assert m["zorro/dedup_ratio"][0] > 1.0 and m["zorro/prompt_tokens_saved"][0] > 0


def test_microbatches_keep_groups_and_budget(engines):
    from tests.support.verl_engines import make_engine_batch
    from zorro_verl.integrations.verl.v09.batching import row_group_ids, row_lengths
    from zorro_verl.packing.microbatch import microbatch_cost

    _, zorro = engines
    td = make_engine_batch(batch_size=12, num_prompts=4, prompt_len=8, response_len=5, seed=5, shuffle=True,
                           use_dynamic_bsz=True, max_token_len=30)
    mbs = zorro.zorro_micro_batches(td)
    p, r = row_lengths(td)
    g = row_group_ids(td, p)
    assert sorted(b for mb in mbs.batches for b in mb) == list(range(12))
    assert all(microbatch_cost(mb, g, p, r) <= 30 for mb in mbs.batches)
    # the ordinary (per-row) token count of some micro-batch exceeds the budget: dedup packs more per micro-batch
    assert any(int((p[mb] + r[mb]).sum()) > 30 for mb in mbs.batches)


@pytest.mark.parametrize("dynamic, ckpt_grad, logits_mode", [
    (False, False, "none"),
    (True, True, "none"),
    (False, True, "compute"),
    (True, False, "memory"),
])
def test_training_steps_match_stock(verl_cpu, tiny_ckpt, strategy, dynamic, ckpt_grad, logits_mode):
    """Two optimizer steps on two batches (each step's inference pass runs on the weights the previous steps
    left): log-probs, entropy, loss, grad norm and every parameter's (clipped) gradient equal stock at every step."""
    from tests.support.verl_engines import (
        STEPS_OPTIM,
        assert_steps_match,
        build_engine,
        make_engine_batch,
        run_steps,
        step_errors,
    )

    batches = [make_engine_batch(batch_size=10, num_prompts=3, prompt_len=7, response_len=6, seed=11 + k,
                                 shuffle=True, temperature=0.9, calculate_entropy=True, use_dynamic_bsz=dynamic,
                                 micro_batch_size=2, max_token_len=40) for k in range(2)]
    runs = []
    for z in (False, True):
        eng = build_engine(tiny_ckpt, zorro=z, strategy=strategy, gradient_checkpointing=ckpt_grad,
                           optim_overrides=STEPS_OPTIM,
                           zorro_settings={"logits_optimization": logits_mode} if z else None)
        if z:
            eng.logits_chunk_size = 4  # several chunks per micro-batch in the compute / memory modes
        runs.append(run_steps(eng, batches))
    assert_steps_match(step_errors(*runs, batches), ATOL, RTOL)
    assert runs[1][0]["tr"]["metrics"]["zorro/split_groups"][0] >= 0
    assert any("lm_head" in k for k in runs[1][0]["grads"])  # per-parameter gradients, also under FSDP1


def test_unsupported_raise_and_warn(verl_cpu, tiny_ckpt, strategy, engines, caplog):
    from verl.utils import tensordict_utils as tu

    from tests.support.verl_engines import build_engine, make_engine_batch

    stock, zorro = engines
    td = make_engine_batch(batch_size=6, num_prompts=2, seed=2)
    tu.assign_non_tensor(td, calculate_sum_pi_squared=True)
    with pytest.raises(ValueError, match="calculate_sum_pi_squared"):
        infer(zorro, td)
    warn = build_engine(tiny_ckpt, zorro=True, strategy=strategy, zorro_settings={"on_unsupported": "warn"})
    with caplog.at_level(logging.WARNING):
        out1 = infer(warn, td)
        out2 = infer(warn, td)
    assert sum("calculate_sum_pi_squared" in r.getMessage() for r in caplog.records) == 1  # warned once
    assert out1["metrics"]["zorro/fallback_batches"] == [1.0] and out2["metrics"]["zorro/fallback_batches"] == [1.0]
    ref = infer(stock, td)
    mask = td["response_mask"].bool()
    assert (output_values(ref, td, "log_probs") - output_values(out1, td, "log_probs"))[mask].abs().max().item() <= ATOL
    # after the fallback the engine is back on zorro attention
    td2 = make_engine_batch(batch_size=6, num_prompts=2, seed=2)
    assert infer(warn, td2)["metrics"]["zorro/fallback_batches"] == [0.0]


def test_disabled_engine_is_stock(verl_cpu, tiny_ckpt):
    from tests.support.verl_engines import build_engine, make_engine_batch

    eng = build_engine(tiny_ckpt, zorro=True, zorro_settings={"enable": False})
    out = infer(eng, make_engine_batch(batch_size=4, num_prompts=2))
    assert not any(k.startswith("zorro/") for k in out["metrics"])
    assert eng.module.config._attn_implementation == "sdpa"


def test_per_sample_temperature(engines):
    from tests.support.verl_engines import make_engine_batch

    stock, zorro = engines
    td = make_engine_batch(batch_size=8, num_prompts=3, seed=9, micro_batch_size=2)
    del td["temperature"]
    td["temperature"] = torch.linspace(0.5, 1.5, 8)  # one temperature per row
    a, b = infer(stock, td), infer(zorro, td)
    mask = td["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        assert (output_values(a, td, key) - output_values(b, td, key))[mask].abs().max().item() <= ATOL


def test_empty_multimodal_field_is_text_only(engines):
    """verl's V1 agent loop puts an empty ``multi_modal_inputs`` dict per sample on text batches: still zorro."""
    from verl.utils import tensordict_utils as tu

    from tests.support.verl_engines import make_engine_batch

    _, zorro = engines
    td = make_engine_batch(batch_size=4, num_prompts=2, seed=4)
    tu.assign_non_tensor_stack(td, "multi_modal_inputs", [{} for _ in range(4)])
    assert infer(zorro, td)["metrics"]["zorro/fallback_batches"] == [0.0]
    tu.assign_non_tensor_stack(td, "multi_modal_inputs", [{"pixel_values": torch.zeros(1, 3)} for _ in range(4)])
    with pytest.raises(ValueError, match="multimodal"):
        infer(zorro, td)


def test_nested_prompts_responses_layout(engines):
    """V1 trainer batches carry jagged ``prompts`` / ``responses`` (no attention_mask split): same results."""
    from tests.support.verl_engines import make_engine_batch

    stock, zorro = engines
    td = make_engine_batch(batch_size=8, num_prompts=3, seed=12, micro_batch_size=2)
    am, P = td["attention_mask"], td["prompts"].shape[1]
    prompts = [td["prompts"][i][am[i, :P].bool()] for i in range(8)]
    responses = [td["responses"][i][am[i, P:].bool()] for i in range(8)]
    ref = infer(stock, td)
    mask = td["response_mask"].bool()
    want = output_values(ref, td, "log_probs")
    td2 = td.clone()
    del td2["prompts"], td2["responses"]
    td2["prompts"] = torch.nested.as_nested_tensor(prompts, layout=torch.jagged)
    td2["responses"] = torch.nested.as_nested_tensor(responses, layout=torch.jagged)
    got = output_values(infer(zorro, td2), td, "log_probs")
    assert (want - got)[mask].abs().max().item() <= ATOL


def test_memory_mode_forward_only(verl_cpu, tiny_ckpt, strategy, engines):
    """logits_optimization=memory: chunked head for log-prob passes (training steps: test_memory.py)."""
    from tests.support.verl_engines import build_engine, make_engine_batch

    stock, _ = engines
    mem = build_engine(tiny_ckpt, zorro=True, strategy=strategy, zorro_settings={"logits_optimization": "memory"})
    td = make_engine_batch(batch_size=12, num_prompts=3, prompt_len=7, response_len=6, seed=3, temperature=0.7,
                           micro_batch_size=3)
    a, b = infer(stock, td), infer(mem, td)
    mask = td["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        assert (output_values(a, td, key) - output_values(b, td, key))[mask].abs().max().item() <= ATOL
    assert b["metrics"]["zorro/fallback_batches"] == [0.0]


def test_batch_without_the_trainer_balance_stamp_warns_once_and_counts(engines, caplog):
    """The trainer's balance hook stamps each batch's meta data (markers.mark_balanced), which verl hands to the
    engine as non-tensor data. A zorro-enabled engine given batches without the stamp (the trainer process never
    installed zorro's hooks) warns once, naming the fix, and counts every call in zorro/balance_hooks_missing."""
    from verl.utils import tensordict_utils as tu

    from tests.support.verl_engines import make_engine_batch
    from zorro_verl.integrations.verl.v09.markers import BALANCE_MARKER_KEY, mark_balanced

    _, zorro = engines
    zorro._zorro_warned.discard("balance_hooks_missing")  # earlier tests of this module ran unstamped batches
    td = make_engine_batch(batch_size=4, num_prompts=2, seed=6)
    with caplog.at_level(logging.WARNING):
        outs = [infer(zorro, td) for _ in range(2)]
    assert [o["metrics"]["zorro/balance_hooks_missing"] for o in outs] == [[1.0], [1.0]]
    warned = [r.getMessage() for r in caplog.records if BALANCE_MARKER_KEY in r.getMessage()]
    assert len(warned) == 1, warned
    assert "external_lib=zorro_verl.integrations.verl.v09.plugin" in warned[0]
    assert "VERL_USE_EXTERNAL_PLUGINS" in warned[0] and "group_balance=false" in warned[0]
    meta = {"temperature": 1.0}  # as the trainer's KVBatchMeta.extra_info / DataProto.meta_info
    mark_balanced(meta)
    stamped = td.clone()
    tu.assign_non_tensor(stamped, **meta)
    assert infer(zorro, stamped)["metrics"]["zorro/balance_hooks_missing"] == [0.0]
    zorro.zorro.group_balance = False  # zorro's balancing switched off: nothing to miss
    try:
        assert infer(zorro, td)["metrics"]["zorro/balance_hooks_missing"] == [0.0]
    finally:
        zorro.zorro.group_balance = True
    with pytest.raises(TypeError, match="mark_balanced: expected the batch's meta data dict"):
        mark_balanced(["not", "a", "dict"])


def test_weight_export_for_rollout_equals_checkpoint(engines, tiny_ckpt):
    """verl's ``get_per_tensor_param`` (what the trainer sends to the rollout's weight sync; under FSDP1 it goes
    through ``load_fsdp_model_to_gpu``, adapted for the CPU platform in tests/support/fsdp1_cpu.py) on the zorro
    engine: every checkpoint tensor, by its HF name, unchanged (the fixture's engines only ran inference)."""
    from transformers import AutoModelForCausalLM

    _, zorro = engines
    want = AutoModelForCausalLM.from_pretrained(tiny_ckpt, torch_dtype=torch.float32).state_dict()
    gen, peft = zorro.get_per_tensor_param()
    got = {name: t.detach().float().cpu() for name, t in gen}
    assert peft is None and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_qat_w4a4_refused(verl_cpu, tiny_ckpt):
    """QAT W4A4 observes its activation scale over each micro-batch's tokens, which deduplication changes: refused
    at engine start by name (W4A16, weights only, is token-independent)."""
    from verl.workers.config.engine import QATEngineConfig

    from tests.support.verl_engines import build_engine

    with pytest.raises(ValueError, match=r"QAT W4A4 \(fsdp_config.qat.mode=w4a4\)"):
        build_engine(tiny_ckpt, zorro=True, engine_overrides={"qat": QATEngineConfig(enable=True, mode="w4a4")})
