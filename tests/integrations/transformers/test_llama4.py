"""Llama 4 text (``Llama4ForCausalLM``) through zorro vs the ordinary per-row forward, fp64 on CPU: log-probs,
entropy, the PPO loss and every parameter gradient (tolerances: docs/design/testing.md; measured ~1e-15).

Two things make Llama 4 more than causal softmax:

* its NoPE layers scale the query by ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))`` with ``pos`` read
  from ``arange(seq_len)`` — on the packed row the packed index. zorro moves that scale into its attention with each
  token's own position (integrations/transformers/positions.py). ``floor_scale = 2`` here (real models 8192) so the
  scale changes every other token and the packed-index bug shows on tiny rows; the test of the bug runs the same
  model with the fix switched off;
* its RoPE layers are ``chunked_attention`` (a query sees the keys of its own chunk of ``attention_chunk_size``
  positions of its row): chunk 4 here, cutting inside every prompt and response.

The oracle keeps fp64 through Llama 4's fp32 casts (``testing.fp64.exact_fp64_llama4``); the experts run their eager
kernel (fp64).
"""

import pytest
import torch

from tests.integrations.transformers.test_step import _loss, batch_of
from zorro_verl.integrations.transformers import install_zorro, positions, uninstall_zorro, zorro_step
from zorro_verl.packing import build_plan
from zorro_verl.testing import (
    batch_from_rows,
    grads_of,
    max_rel_grad_error,
    ordinary_logprobs,
    shared_system_rows,
    tiny_llama4_model,
)

ABS_TOL = 1e-9
GRAD_REL_TOL = 1e-8
_MODELS: dict = {}


def _cpu_flash(monkeypatch):
    """The flash backends on CPU: their index and merge logic with the plain-torch varlen primitives."""
    import zorro_verl.attention.copyfree as cf
    from zorro_verl.attention import primitives, varlen

    for mod in (varlen, cf):
        monkeypatch.setattr(mod, "flash_primitives", primitives.torch_primitives)
        monkeypatch.setattr(mod, "check_flash_inputs", lambda name, q: None)


@pytest.fixture
def cpu_flash(monkeypatch):
    _cpu_flash(monkeypatch)


def _models(layer_types, chunk=4):
    """One ordinary and one zorro model per configuration, built once (fresh gradients per comparison)."""
    key = (layer_types, chunk)
    if key not in _MODELS:
        ref = tiny_llama4_model(layer_types=layer_types, chunk=chunk)
        z = tiny_llama4_model(layer_types=layer_types, chunk=chunk)
        install_zorro(z)
        ref.train()
        z.train()
        _MODELS[key] = ref, z
    return _MODELS[key]


def compare(ref, z, batch, *, backend="sdpa", sharing="prompt", mode="none", temperature=1.0):
    for m in (ref, z):
        m.zero_grad(set_to_none=True)
    R = batch["responses"].shape[1]
    lp_ref, ent_ref = ordinary_logprobs(ref, batch["input_ids"], batch["attention_mask"], R,
                                        temperature=temperature, calculate_entropy=True)
    loss_ref = _loss(lp_ref, ent_ref, batch)
    loss_ref.backward()
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R, sharing=sharing, min_shared_len=1) \
        if sharing == "prefix" else build_plan(batch["input_ids"], batch["attention_mask"], R)
    lp, ent = zorro_step(z, plan, backend=backend, temperature=temperature, calculate_entropy=True,
                         logits_optimization=mode, chunk_size=7)
    loss = _loss(lp, ent, batch)
    loss.backward()
    r = dict(plan=plan, lp_err=(lp - lp_ref).abs().max().item(), ent_err=(ent - ent_ref).abs().max().item(),
             loss_err=abs(loss.item() - loss_ref.item()),
             grad_err=max_rel_grad_error(grads_of(ref), grads_of(z))[0])
    assert r["lp_err"] <= ABS_TOL and r["ent_err"] <= ABS_TOL and r["loss_err"] <= ABS_TOL, r
    assert r["grad_err"] <= GRAD_REL_TOL, r
    return r


@pytest.mark.parametrize("backend", ["sdpa", "eager", "standard", "flash", "flash_copyfree"])
def test_nope_temperature_full_layers_every_backend(backend, cpu_flash):
    """layer_types all full_attention, attn_temperature_tuning on: the NoPE layer's query scale from each token's
    own position. Ragged prompts of 7..14 tokens, responses 0..6, siblings interleaved (packed row ~70 tokens)."""
    ref, z = _models("full")
    r = compare(ref, z, batch_of(8, 3, 14, 6, seed=3), backend=backend, mode="compute", temperature=0.8)
    assert r["plan"].G == 3 and r["plan"].T > 2 * 14


@pytest.mark.parametrize("backend", ["sdpa", "eager", "standard", "flash", "flash_copyfree", "flash_copyfree_cpu"])
def test_default_layer_types_chunked_and_nope(backend, monkeypatch):
    """Llama 4's own layer types (3 chunked RoPE layers, chunk 4, then a NoPE full layer with the temperature). The
    flash designs over the plain-torch varlen primitives (one segment per chunk piece), ``flash_copyfree_cpu`` on
    its CPU flash kernels as registered."""
    if backend in ("flash", "flash_copyfree"):
        _cpu_flash(monkeypatch)
    backend = backend.replace("_cpu", "")
    ref, z = _models("default")
    assert z.zorro_features["attention_chunk"] == {0: 4, 1: 4, 2: 4}
    assert z.zorro_features["query_temperature"] == ["model.layers.3.self_attn"]
    compare(ref, z, batch_of(8, 3, 14, 6, seed=5), backend=backend)


@pytest.mark.parametrize("backend", ["sdpa", "standard", "flash"])
def test_default_layer_types_prefix_sharing(backend, cpu_flash):
    """Prefix trees: a 10-token system prompt shared by 3 questions of 3 tokens, 2 samples each (nodes crossing chunk
    boundaries; a response's chunk reaches into its question and system prompt)."""
    ref, z = _models("default")
    rows = shared_system_rows(3, 2, system_len=10, question_len=3, response_len=5, vocab_size=100, seed=2)
    batch = batch_from_rows(rows, include_training_fields=True)
    r = compare(ref, z, batch, backend=backend, sharing="prefix", mode="memory")
    assert r["plan"].tree is not None


def test_gradient_checkpointing():
    ref, z = tiny_llama4_model(), tiny_llama4_model()
    install_zorro(z)
    for m in (ref, z):
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compare(ref, z, batch_of(seed=7), backend="eager")


def test_flex_forward():
    ref, z = _models("default")
    batch = batch_of(seed=9)
    R = batch["responses"].shape[1]
    with torch.no_grad():
        lp_ref, _ = ordinary_logprobs(ref, batch["input_ids"], batch["attention_mask"], R)
        lp, _ = zorro_step(z, build_plan(batch["input_ids"], batch["attention_mask"], R), backend="flex")
    assert (lp - lp_ref).abs().max().item() <= ABS_TOL


def test_the_fix_and_the_chunks_matter(monkeypatch):
    """Teeth: without zorro's temperature fix the NoPE layer scales queries by their packed index (the error shows
    at ~0.1 and the install probe refuses the model, naming the layer); the chunk rule and the temperature each
    change the ordinary log-probs."""
    batch = batch_of(8, 3, 14, 6, seed=3)
    R = batch["responses"].shape[1]
    plan = build_plan(batch["input_ids"], batch["attention_mask"], R)
    ref, _ = _models("full")
    monkeypatch.setattr(positions, "fix_query_temperature", lambda model: 0)  # the module's own arange scale
    z = tiny_llama4_model(layer_types="full")
    with pytest.raises(ValueError, match=r"install probe: module model\.layers\.3\.self_attn\.o_proj \(Linear, in "
                                         r"model\.layers\.3\.self_attn \(Llama4TextAttention\)\) gives a different "
                                         r"output on zorro's packed row"):
        install_zorro(z)
    assert z.config._attn_implementation != "zorro"  # restored
    install_zorro(z, probe=False)
    with torch.no_grad():
        lp_ref, _ = ordinary_logprobs(ref, batch["input_ids"], batch["attention_mask"], R)
        lp, _ = zorro_step(z, plan)
    assert (lp - lp_ref).abs().max().item() > 1e-2
    uninstall_zorro(z)
    with torch.no_grad():
        for kw in (dict(layer_types="full", chunk=4), dict(layer_types="default", chunk=64),
                   dict(layer_types="default", floor_scale=8192)):
            other, _ = ordinary_logprobs(tiny_llama4_model(**kw), batch["input_ids"], batch["attention_mask"], R)
            base, _ = ordinary_logprobs(tiny_llama4_model(), batch["input_ids"], batch["attention_mask"], R)
            assert (other - base).abs().max().item() > 1e-4, kw


def test_uninstall_restores_the_modules_own_temperature():
    z = tiny_llama4_model()
    attn = z.model.layers[3].self_attn
    install_zorro(z)
    assert attn.attn_temperature_tuning is False
    uninstall_zorro(z)
    assert attn.attn_temperature_tuning is True and not hasattr(attn, "_zorro_query_temperature")
