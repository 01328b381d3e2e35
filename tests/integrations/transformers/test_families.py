"""Model families through zorro vs the ordinary per-row forward, fp64 on CPU: log-probs, entropy, the PPO loss and
every parameter gradient. Mainly those whose attention is more than causal softmax — sliding-window layers (gpt-oss,
Gemma 2, Gemma 3, Mistral, Qwen3 with use_sliding_window), attention sinks (gpt-oss) and logit soft-capping
(Gemma 2) — on every backend (the flash designs over the plain-torch varlen primitives); plus the plain causal
families Llama, Qwen2 and OLMo2 (Qwen3 / Qwen3-MoE: test_step.py).

The oracle's attention is transformers' eager one with its own masks (causal + each layer's sliding window, from
``config.layer_types``) but the softmax in fp64 (``testing.fp64.fp64_eager_attention``; Gemma's and Mistral's eager
upcast to fp32 only, gpt-oss' keeps the dtype — checked below), and the norms fp64-exact (``exact_fp64_norms``).
gpt-oss' experts run their eager kernel, which has fp64, so its MoE is compared in fp64 too.
"""

import pytest
import torch

from tests.integrations.transformers.test_step import batch_of, run_pair
from zorro_verl.integrations.transformers import install_zorro, uninstall_zorro, zorro_step
from zorro_verl.packing import build_plan
from zorro_verl.testing import WINDOW_KINDS, ordinary_logprobs, tiny_window_model

REL_TOL = 1e-9
ABS_TOL = 1e-9

#: Worst errors per family (printed by conftest's terminal summary).
WORST: dict = {}


@pytest.fixture
def cpu_flash(monkeypatch):
    """The flash backends on CPU: their index and merge logic with the plain-torch varlen primitives."""
    import zorro_verl.attention.copyfree as cf
    from zorro_verl.attention import primitives, varlen

    for mod in (varlen, cf):
        monkeypatch.setattr(mod, "flash_primitives", primitives.torch_primitives)
        monkeypatch.setattr(mod, "check_flash_inputs", lambda name, q: None)


def _assert_exact(kind, r):
    w = WORST.setdefault(kind, {"log-prob abs": 0.0, "entropy abs": 0.0, "loss abs": 0.0, "grad rel": 0.0})
    for key, val in (("log-prob abs", r["lp_err"]), ("entropy abs", r["ent_err"]), ("loss abs", r["loss_err"]),
                     ("grad rel", r["grad_err"][0])):
        w[key] = max(w[key], val)
    assert r["lp_err"] <= ABS_TOL and r["ent_err"] <= ABS_TOL and r["loss_err"] <= ABS_TOL, r
    assert r["grad_err"][0] <= REL_TOL, r


@pytest.mark.parametrize("backend", ["sdpa", "eager", "standard", "flash", "flash_copyfree"])
@pytest.mark.parametrize("kind", WINDOW_KINDS)
def test_family_exact_every_backend(kind, backend, cpu_flash):
    """Window 5 against ragged prompts of 7..14 tokens and responses of 0..6 (1-token and empty ones, siblings
    interleaved): the window cuts inside every prompt for every response token."""
    batch = batch_of(8, 3, 14, 6, seed=len(kind) * 10 + len(backend))
    r = run_pair(kind, backend, "none", 0.8, batch=batch, make=tiny_window_model, model_kwargs=dict(window=5))
    assert r["plan"].G == 3 and int(r["plan"].response_lens.min()) == 0
    _assert_exact(kind, r)


@pytest.mark.parametrize("window", [3, 9, 16, 20])
def test_mistral_windows_smaller_and_larger_than_the_prompt(window):
    """Prompts of 10, 8 and 14 tokens, rows up to 20: window 3 cuts inside every prompt; 9 cuts inside the 10- and
    14-token prompts for a response's first token but sees all of the 8-token one; 16 is longer than every prompt
    but cuts the longest rows' late tokens off their prompt's start; 20 (the longest row) cuts nothing and is
    dropped as a no-op."""
    batch = batch_of(8, 3, 14, 6, seed=0)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], 6)
    assert plan.prompt_lens.tolist() == [10, 8, 14] and plan.max_row_len == 20
    r = run_pair("mistral", "sdpa", "compute", 1.0, batch=batch, make=tiny_window_model,
                 model_kwargs=dict(window=window))
    _assert_exact("mistral", r)


@pytest.mark.parametrize("kind", ["gpt_oss", "gemma2"])
def test_gradient_checkpointing_and_logits_modes(kind):
    r = run_pair(kind, "eager", "compute", 0.7, checkpointing=True, batch=batch_of(seed=21), make=tiny_window_model,
                 model_kwargs=dict(window=4))
    _assert_exact(kind, r)


def test_the_features_matter():
    """Teeth: the same models without their window / sinks / soft-cap give clearly different log-probs, so the
    exactness above is not vacuous."""
    batch = batch_of(seed=3)
    R = batch["responses"].shape[1]
    for kind, off in (("mistral", dict(window=4096)), ("gemma2", dict(attn_softcap=None, window=4096)),
                      ("gpt_oss", dict(window=4096))):
        with torch.no_grad():
            lp, _ = ordinary_logprobs(tiny_window_model(kind, window=4), batch["input_ids"], batch["attention_mask"], R)
            model = tiny_window_model(kind, **off)
            if kind == "gpt_oss":
                for layer in model.model.layers:
                    layer.self_attn.sinks.fill_(-1e4)  # sinks switched off
            lp_off, _ = ordinary_logprobs(model, batch["input_ids"], batch["attention_mask"], R)
        assert (lp - lp_off).abs().max().item() > 1e-3, kind


def test_fp64_oracle_is_transformers_eager():
    """The oracle attention equals transformers' own eager path: exactly for gpt-oss (whose eager softmax keeps
    fp64), to fp32 softmax rounding for Gemma 2/3 and Mistral (which upcast to fp32 only)."""
    batch = batch_of(seed=8)
    R = batch["responses"].shape[1]
    for kind, tol in (("gpt_oss", 1e-13), ("gemma2", 1e-6), ("gemma3", 1e-6), ("mistral", 1e-6)):
        with torch.no_grad():
            a, _ = ordinary_logprobs(tiny_window_model(kind, window=4), batch["input_ids"], batch["attention_mask"], R)
            b, _ = ordinary_logprobs(tiny_window_model(kind, window=4, attn_implementation="eager"),
                                     batch["input_ids"], batch["attention_mask"], R)
        assert (a - b).abs().max().item() <= tol, kind


def test_flex_forward_matches():
    batch = batch_of(seed=12)
    R = batch["responses"].shape[1]
    for kind in ("gpt_oss", "gemma2"):
        ref, z = tiny_window_model(kind, window=4), tiny_window_model(kind, window=4)
        install_zorro(z)
        plan = build_plan(batch["input_ids"], batch["attention_mask"], R)
        with torch.no_grad():
            lp_ref, ent_ref = ordinary_logprobs(ref, batch["input_ids"], batch["attention_mask"], R,
                                                calculate_entropy=True)
            lp, ent = zorro_step(z, plan, backend="flex", calculate_entropy=True)
        assert (lp - lp_ref).abs().max().item() <= ABS_TOL and (ent - ent_ref).abs().max().item() <= ABS_TOL


def test_probe_reports_the_features_it_saw():
    rep = install_zorro(tiny_window_model("gpt_oss", window=4))
    assert rep["attention_layers"] == 3 and rep["sliding_window"] == {0: 4, 2: 4} and rep["sinks"] == [0, 1, 2]
    assert rep["attn_logit_softcapping"] == {} and rep["final_logit_softcapping"] is None
    model = tiny_window_model("gemma2", window=4)
    rep = install_zorro(model)
    assert rep["sliding_window"] == {0: 4, 2: 4} and rep["sinks"] == []
    assert rep["attn_logit_softcapping"] == {0: 1.0, 1: 1.0, 2: 1.0} and rep["final_logit_softcapping"] == 3.0
    assert rep["scaling"] == [model.config.query_pre_attn_scalar ** -0.5] and model.zorro_features is rep
    rep = install_zorro(tiny_window_model("mistral", window=6))
    assert rep["sliding_window"] == {0: 6, 1: 6, 2: 6}


def test_gemma2_final_logit_softcap_exact_in_compute_mode_refused_in_memory_mode():
    """The final soft-cap runs in the model's own forward on the kept logits (modes none / compute); the chunked
    head of the memory mode cannot apply it and refuses loudly."""
    batch = batch_of(seed=6)
    r = run_pair("gemma2", "sdpa", "compute", 1.0, batch=batch, make=tiny_window_model, model_kwargs=dict(window=4))
    _assert_exact("gemma2", r)
    model = tiny_window_model("gemma2")
    install_zorro(model)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1])
    with pytest.raises(ValueError, match="final_logit_softcapping=3.0"):
        zorro_step(model, plan, logits_optimization="memory")


def test_refused_at_install():
    model = tiny_window_model("mistral")
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention_dropout"):
        install_zorro(model)
    model = tiny_window_model("gemma3")
    model.config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="bidirectional"):
        install_zorro(model)
    model = tiny_window_model("gemma3")
    # a layer type zorro does not handle
    model.config.layer_types = ["sliding_attention", "heavily_compressed_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layers of type \['heavily_compressed_attention'\]"):
        install_zorro(model)
    # a layer whose window disagrees with its layer type (the ordinary mask follows the type): probe refuses
    model = tiny_window_model("gpt_oss", window=4)
    model.model.layers[1].self_attn.sliding_window = 4
    with pytest.raises(ValueError, match="layer 1 passed sliding_window=4"):
        install_zorro(model)
    assert model.config._attn_implementation != "zorro"  # restored
    # without the probe (verl's engines) every step checks the windows it saw
    model.model.layers[1].self_attn.sliding_window = None
    install_zorro(model, probe=False)
    model.model.layers[0].self_attn.sliding_window = 3
    batch = batch_of(seed=1)
    with pytest.raises(ValueError, match="layer 0 passed sliding_window=3"):
        zorro_step(model, build_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1]))


def test_unknown_or_math_changing_keywords_are_refused():
    """No keyword reaches zorro's attention unread: an unknown one, training-mode dropout, a non-causal call."""
    from zorro_verl.integrations.transformers import StepContext
    from zorro_verl.integrations.transformers.attention import zorro_attention_forward

    batch = batch_of(seed=2)
    plan = build_plan(batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1])
    model = tiny_window_model("mistral")
    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, plan.T, 8, dtype=torch.float64)
    kv = torch.zeros(1, 2, plan.T, 8, dtype=torch.float64)
    ctx = StepContext(plan)
    out, _ = zorro_attention_forward(attn, q, kv, kv, None, scaling=0.5, sliding_window=3, position_ids=None,
                                     use_cache=False, zorro_ctx=ctx)
    assert out.shape == (1, plan.T, 4, 8)
    for kw, match in ((dict(alibi_slopes=1), "alibi_slopes"), (dict(dropout=0.1), "dropout"),
                      (dict(is_causal=False), "bidirectionally"), (dict(output_attentions=True), "output_attentions")):
        with pytest.raises(ValueError, match=match):
            zorro_attention_forward(attn, q, kv, kv, None, zorro_ctx=ctx, **kw)
    uninstall_zorro(model)


def _qwen3_sliding(kind, window=4):
    """Qwen3 with its own sliding-window switch (``use_sliding_window``, ``max_window_layers``): layer 1 windowed."""
    from transformers import Qwen3Config

    from zorro_verl.testing import exact_fp64_norms, model_from_config

    cfg = Qwen3Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, use_sliding_window=True,
                      sliding_window=window, max_window_layers=1, attention_dropout=0.0)
    model = model_from_config(cfg, torch.float64, 0, "sdpa")
    exact_fp64_norms(model)
    return model


def test_qwen3_with_sliding_window_layers():
    model = _qwen3_sliding("qwen3")
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert install_zorro(model)["sliding_window"] == {1: 4}
    r = run_pair("qwen3", "sdpa", "none", 1.0, batch=batch_of(seed=4), make=_qwen3_sliding)
    _assert_exact("qwen3 (sliding)", r)


def _plain(kind, **_):
    """Causal-softmax families besides Qwen3 (tested in test_step.py), tiny, fp64, sdpa oracle."""
    import transformers

    from zorro_verl.testing import exact_fp64_norms, model_from_config

    cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "olmo2": "Olmo2Config"}[kind]
    cfg = getattr(transformers, cls)(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=64, attention_dropout=0.0,
                                     max_position_embeddings=4096)
    model = model_from_config(cfg, torch.float64, 0, "sdpa")
    exact_fp64_norms(model)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "olmo2"])
def test_plain_causal_families(kind):
    rep = install_zorro(_plain(kind))
    assert rep["sliding_window"] == {} and rep["sinks"] == [] and rep["attn_logit_softcapping"] == {}
    _assert_exact(kind, run_pair(kind, "sdpa", "none", 0.9, batch=batch_of(seed=31), make=_plain))
