"""The zorro engine with verl's fused kernels (use_fused_kernels=true) vs verl 0.9.1's stock engine with and without
them, on CPU (fp32, 1-rank gloo, verl's torch fused backend), under FSDP2 and FSDP1 (the ``strategy`` fixture).

Tolerances (docs/design/testing.md): log-probs / entropy max abs <= 1e-5; loss, grad norm and every gradient relative
<= 1e-5 (fp32).

verl patches the model *class's* forward for fused kernels (for the whole process); the engines without fused
kernels run under :func:`_class_forward` with transformers' own forward restored, and the module restores it at the
end so other test modules see an unpatched class.

verl 0.9.1's own fused forward reads ``lm_head.weight`` without calling the head module, and FSDP2 wraps an untied
head as its own unit, so on untied models under FSDP2 verl's fused path fails (pinned by
``test_stock_fused_fails_on_untied_head``); there zorro, whose fused head runs as the head module's forward, is
compared with the stock engine without fused kernels (the same math). On tied models, and under FSDP1 (verl's
default wrap policy keeps the head in the root unit), it is compared with both stock engines.

Under FSDP1 zorro's step forward is set on the model inside the FSDP1 wrapper, so the wrapper's own forward (lazy
root initialisation, unshard, backward hooks) still runs. Set on the wrapper, it skipped all that:
``test_training_steps_match_stock[fsdp-*]`` failed at the first call (FSDP1 then initialises a decoder-layer unit as
its root: "Non-root FSDP instance's ``_is_root`` should not have been set yet"; a training-only run failed at its
second step: "a view ... has been modified inplace"; 2 ranks: ``test_two_ranks.py``).
"""

import logging
from contextlib import contextmanager, nullcontext
from functools import partial

import pytest
import torch

from tests.support.verl_engines import infer, output_values

pytestmark = pytest.mark.usefixtures("verl_cpu")  # skips without verl 0.9

ATOL = 1e-5
RTOL = 1e-5
FUSED_MODEL = {"use_fused_kernels": True, "fused_kernel_options": {"impl_backend": "torch"}}
FUSED_ENGINE = {"use_fused_kernels": True}  # verl's worker copies the model config's flag into the engine config


def _model_class():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM

    return Qwen3ForCausalLM


@pytest.fixture(scope="module", autouse=True)
def original_forward():
    """transformers' own ``Qwen3ForCausalLM.forward``, restored after this module (verl patches the class)."""
    cls = _model_class()
    fwd = cls.__dict__["forward"]
    assert not fwd.__module__.startswith("verl."), "the class was already patched by verl before this module"
    yield fwd
    cls.forward = fwd


@contextmanager
def _class_forward(fwd):
    cls = _model_class()
    saved = cls.__dict__["forward"]
    cls.forward = fwd
    try:
        yield
    finally:
        cls.forward = saved


@pytest.fixture(scope="module")
def tied_ckpt(tmp_path_factory):
    """The tiny fp32 Qwen3 of ``tiny_ckpt`` with tied input / output embeddings."""
    from zorro_verl.testing import tiny_model

    path = tmp_path_factory.mktemp("tiny_qwen3_tied")
    model = tiny_model("qwen3", dtype=torch.float32, seed=1, tie_word_embeddings=True)
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.save_pretrained(path)
    return str(path)


def _ckpt(request, tied):
    return request.getfixturevalue("tied_ckpt" if tied else "tiny_ckpt")


def _build(ckpt, kind, original_forward, **kw):
    """``kind``: ``plain`` (stock, no fused kernels), ``fused`` (stock, fused) or ``zorro`` (zorro, fused)."""
    from tests.support.verl_engines import build_engine

    if kind == "plain":
        with _class_forward(original_forward):
            return build_engine(ckpt, zorro=False, **kw)
    return build_engine(ckpt, zorro=kind == "zorro", model_overrides=FUSED_MODEL, engine_overrides=FUSED_ENGINE,
                        **kw)


def _kinds(tied: bool, strategy: str) -> tuple:
    """The engines to build: verl's stock fused path fails on an untied head under FSDP2 (module docstring)."""
    return ("plain", "fused", "zorro") if tied or strategy == "fsdp" else ("plain", "zorro")


def _batch(fused=True, **kw):
    from verl.utils import tensordict_utils as tu

    from tests.support.verl_engines import make_engine_batch

    td = make_engine_batch(**kw)
    tu.assign_non_tensor(td, use_fused_kernels=fused)
    return td


@pytest.fixture(scope="module")
def engines(request, original_forward):
    """``{(tied, strategy): (plain stock, fused stock or None (see _kinds), fused zorro)}``, built on first use."""
    cache = {}

    def get(tied, strategy="fsdp2"):
        if (tied, strategy) not in cache:
            ckpt = _ckpt(request, tied)
            built = {k: _build(ckpt, k, original_forward, strategy=strategy) for k in _kinds(tied, strategy)}
            cache[tied, strategy] = (built["plain"], built.get("fused"), built["zorro"])
        return cache[tied, strategy]

    return get


@pytest.mark.parametrize("dynamic, rmpad, temperature, entropy, tied", [
    (False, True, 1.0, True, False),
    (False, False, 0.7, True, False),
    (True, True, 0.7, False, False),
    (True, False, 1.3, True, False),
    (False, True, 0.8, True, True),
    (True, True, 1.2, True, True),
])
def test_infer_matches_stock(engines, original_forward, monkeypatch, strategy, dynamic, rmpad, temperature, entropy,
                             tied):
    from verl.utils.experimental import torch_functional

    from zorro_verl.integrations.transformers.step import forward_owner

    plain, fused, zorro = engines(tied, strategy)
    td = _batch(batch_size=12, num_prompts=3, prompt_len=7, response_len=6, seed=3, shuffle=True,
                temperature=temperature, calculate_entropy=entropy, use_dynamic_bsz=dynamic, micro_batch_size=3,
                max_token_len=40, use_remove_padding=rmpad)
    with _class_forward(original_forward):
        ref = infer(plain, _batch(fused=False, batch_size=12, num_prompts=3, prompt_len=7, response_len=6, seed=3,
                                   shuffle=True, temperature=temperature, calculate_entropy=entropy,
                                   use_dynamic_bsz=dynamic, micro_batch_size=3, max_token_len=40,
                                   use_remove_padding=rmpad))
    refs = {"plain": ref}
    if fused is not None:
        refs["fused"] = infer(fused, td)
    rows, apply = [], torch_functional.FusedLinearForPPOFunction.apply

    def spy(hidden, *args):  # verl's fused kernel, on the response-predicting rows only
        rows.append(hidden.shape[0])
        return apply(hidden, *args)

    monkeypatch.setattr(torch_functional.FusedLinearForPPOFunction, "apply", spy)
    b = infer(zorro, td)
    monkeypatch.undo()
    mask = td["response_mask"].bool()
    assert sum(rows) == int(mask.sum())
    lp_b = output_values(b, td, "log_probs")
    for name, a in refs.items():
        lp_a = output_values(a, td, "log_probs")
        assert mask.sum() > 20 and lp_a[mask].abs().max() > 1.0  # a real comparison, not zeros
        assert (lp_a - lp_b)[mask].abs().max().item() <= ATOL, name
        if entropy:
            e_a, e_b = output_values(a, td, "entropy"), output_values(b, td, "entropy")
            assert (e_a - e_b)[mask].abs().max().item() <= ATOL, name
            assert b["model_output"]["entropy"].dtype == a["model_output"]["entropy"].dtype
        else:
            assert "entropy" not in b["model_output"]
    m = b["metrics"]
    assert m["zorro/fallback_batches"] == [0.0]  # zorro ran, no stock fallback
    assert m["zorro/dedup_ratio"][0] > 1.0 and m["zorro/prompt_tokens_saved"][0] > 0
    # the step left the root module's forward as it found it (verl's patched class forward), FSDP1's wrapper too
    assert "forward" not in zorro.module.__dict__ and "forward" not in forward_owner(zorro.module).__dict__


def _loss_fn():
    """verl's ppo_loss with an entropy bonus, so the entropy's gradient path is part of the comparison."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    cfg = FSDPActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=8,
                          use_dynamic_bsz=False, loss_agg_mode="token-mean", use_kl_loss=False, entropy_coeff=0.05)
    return partial(ppo_loss, cfg)


@pytest.mark.parametrize("dynamic, ckpt_grad, tied, logits_mode", [
    (False, False, True, "none"),
    (True, True, True, "none"),
    (False, False, False, "none"),
    (True, False, False, "memory"),  # the fused head replaces the logits mode, also in training steps
])
def test_training_steps_match_stock(request, original_forward, strategy, dynamic, ckpt_grad, tied, logits_mode):
    """Two optimizer steps (the second step's inference pass and forward run on the updated weights): log-probs,
    entropy, loss, grad norm and every gradient equal each stock engine's at every step."""
    from tests.support.verl_engines import STEPS_OPTIM, assert_steps_match, run_steps, step_errors

    ckpt = _ckpt(request, tied)
    kw = [dict(batch_size=10, num_prompts=3, prompt_len=7, response_len=6, seed=11 + k, shuffle=True,
               temperature=0.9, calculate_entropy=True, use_dynamic_bsz=dynamic, micro_batch_size=2, max_token_len=40)
          for k in range(2)]
    runs = {}
    kinds = _kinds(tied, strategy)
    for kind in kinds:
        settings = {"zorro_settings": {"logits_optimization": logits_mode}} if kind == "zorro" else {}
        eng = _build(ckpt, kind, original_forward, gradient_checkpointing=ckpt_grad, strategy=strategy,
                     optim_overrides=STEPS_OPTIM, **settings)
        batches = [_batch(fused=kind != "plain", **k) for k in kw]
        with _class_forward(original_forward) if kind == "plain" else nullcontext():
            runs[kind] = run_steps(eng, batches, loss_function=_loss_fn())
    for ref in kinds[:-1]:
        assert_steps_match(step_errors(runs[ref], runs["zorro"], batches), ATOL, RTOL)


def test_per_sample_temperature_refused_as_verl(request, original_forward, engines, caplog):
    """verl's fused path asserts a float temperature; zorro refuses the batch the same way (raise, or warn and run
    the stock forward, which then fails as verl does)."""
    _, fused, zorro = engines(True)
    td = _batch(batch_size=8, num_prompts=2, seed=4)
    del td["temperature"]
    td["temperature"] = torch.linspace(0.5, 1.5, 8)  # one temperature per row
    with pytest.raises(AssertionError, match="per sample temperature"):
        infer(fused, td)
    with pytest.raises(ValueError, match="temperature"):
        infer(zorro, td)
    warn = _build(request.getfixturevalue("tiny_ckpt"), "zorro", original_forward,
                  zorro_settings={"on_unsupported": "warn"})
    with caplog.at_level(logging.WARNING), pytest.raises(AssertionError, match="per sample temperature"):
        infer(warn, td)
    assert sum("temperature" in r.getMessage() and "fused" in r.getMessage() for r in caplog.records) == 1
    # a uniform float temperature runs zorro again
    assert infer(warn, _batch(batch_size=8, num_prompts=2, seed=4))["metrics"]["zorro/fallback_batches"] == [0.0]


def test_sum_pi_squared_refused_as_verl(engines):
    from verl.utils import tensordict_utils as tu

    _, fused, zorro = engines(True)
    td = _batch(batch_size=6, num_prompts=2, seed=2)
    tu.assign_non_tensor(td, calculate_sum_pi_squared=True)
    with pytest.raises(NotImplementedError, match="calculate_sum_pi_squared"):
        infer(fused, td)
    with pytest.raises(ValueError, match="calculate_sum_pi_squared"):
        infer(zorro, td)


def test_unpatched_model_raises(tiny_ckpt, original_forward):
    """use_fused_kernels without a fused backend: verl does not patch the model, and zorro says so."""
    from tests.support.verl_engines import build_engine

    with _class_forward(original_forward):
        eng = build_engine(tiny_ckpt, zorro=True, engine_overrides=FUSED_ENGINE,
                           model_overrides={"use_fused_kernels": True})
        with pytest.raises(ValueError, match="impl_backend"):
            infer(eng, _batch(batch_size=6, num_prompts=2, seed=2))


def test_stock_fused_fails_on_untied_head(tiny_ckpt, original_forward):
    """verl 0.9.1 fact: its fused forward multiplies by ``lm_head.weight`` outside the head module, which FSDP2
    shards as its own unit when untied; zorro's fused head runs inside the head module (tested above)."""
    eng = _build(tiny_ckpt, "fused", original_forward)
    with pytest.raises(RuntimeError, match="DTensor"):
        infer(eng, _batch(batch_size=6, num_prompts=2, seed=2))


def test_prefix_sharing_with_fused_kernels(request, original_forward, strategy):
    """``sharing=prefix`` with verl's fused kernels (the head function gets each output's hidden state): the zorro
    fused engine on an agentic batch vs the stock engine without fused kernels (the same math)."""
    from verl.utils import tensordict_utils as tu

    from tests.integrations.verl.v09.test_prefix_engine import PREFIX, _agentic_batch

    ckpt = _ckpt(request, False)
    with _class_forward(original_forward):
        plain = _build(ckpt, "plain", original_forward, strategy=strategy)
        ref_td = _agentic_batch(temperature=0.8, calculate_entropy=True, micro_batch_size=4)
        ref = infer(plain, ref_td)
    zorro = _build(ckpt, "zorro", original_forward, zorro_settings=PREFIX, strategy=strategy)
    td = _agentic_batch(temperature=0.8, calculate_entropy=True, micro_batch_size=4)
    tu.assign_non_tensor(td, use_fused_kernels=True)
    out = infer(zorro, td)
    mask = td["attention_mask"][:, -td["responses"].shape[1]:].bool()
    for key in ("log_probs", "entropy"):
        a, b = output_values(ref, ref_td, key), output_values(out, td, key)
        assert a[mask].abs().max() > 0.1 and (a - b)[mask].abs().max().item() <= ATOL, key
    assert out["metrics"]["zorro/tree_depth"][0] >= 3


def test_lora_with_fused_kernels(request, original_forward, strategy, tmp_path):
    """LoRA and fused kernels at once (a PEFT-wrapped model that verl patched): zorro's step forward goes on the
    ``*ForCausalLM`` inside the ``PeftModel`` (whose forward verl replaced; set on the ``PeftModel`` it resolved
    ``.model`` to that patched model, which dropped zorro's context: "called without zorro's step context").
    Two SGD steps against the stock LoRA engine without fused kernels (the same math; verl's own fused path fails on
    the untied head under FSDP2, see the module docstring): log-probs, entropy, loss, grad norm, every gradient."""
    from tests.support.lora import LORA_TARGETS
    from tests.support.verl_engines import (
        STEPS_OPTIM,
        assert_steps_match,
        build_engine,
        lora_adapter,
        lora_model,
        run_steps,
        step_errors,
    )

    ckpt = request.getfixturevalue("tiny_ckpt")
    lora = lora_model(lora_adapter(ckpt, tmp_path / "adapter", LORA_TARGETS["all-linear"], seed=3),
                      LORA_TARGETS["all-linear"])
    kw = [dict(batch_size=10, num_prompts=3, prompt_len=7, response_len=6, seed=21 + k, shuffle=True,
               temperature=0.9, calculate_entropy=True, micro_batch_size=2, max_token_len=40) for k in range(2)]
    with _class_forward(original_forward):
        plain = build_engine(ckpt, zorro=False, strategy=strategy, model_overrides=lora, optim_overrides=STEPS_OPTIM)
        ref = run_steps(plain, [_batch(fused=False, **k) for k in kw], loss_function=_loss_fn())
    zorro = build_engine(ckpt, zorro=True, strategy=strategy, model_overrides={**lora, **FUSED_MODEL},
                         engine_overrides=FUSED_ENGINE, optim_overrides=STEPS_OPTIM)
    batches = [_batch(fused=True, **k) for k in kw]
    got = run_steps(zorro, batches, loss_function=_loss_fn())
    assert_steps_match(step_errors(ref, got, batches), ATOL, RTOL)
    assert any("lora_" in k for k in got[0]["grads"])  # the adapters trained
