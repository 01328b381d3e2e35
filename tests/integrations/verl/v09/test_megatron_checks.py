"""The Megatron engine's start-time refusals that need no model (``megatron_setup_unsupported``): each names the
setting and how to fix it; verl's defaults pass. Pure data: runs without megatron-core (the engine calls the same
function at start; tests/integrations/megatron/test_engine.py checks it there with LoRA)."""

from types import SimpleNamespace

import pytest

from zorro_verl.integrations.verl.v09.megatron_checks import megatron_setup_unsupported

DEFAULT_ENGINE = {"context_parallel_size": 1, "dynamic_context_parallel": False,
                  "virtual_pipeline_model_parallel_size": None, "use_fused_kernels": False,
                  "router_replay": {"mode": "disabled"}, "tensor_model_parallel_size": 2,
                  "pipeline_model_parallel_size": 2}
DEFAULT_MODEL = {"lora_rank": 0, "mtp": {"enable": False}}


def test_verl_defaults_pass():
    assert megatron_setup_unsupported(DEFAULT_ENGINE, DEFAULT_MODEL) is None
    hf = SimpleNamespace(model_type="qwen3", layer_types=["full_attention"] * 2)
    assert megatron_setup_unsupported(DEFAULT_ENGINE, {**DEFAULT_MODEL, "hf_config": hf}) is None
    # multi-latent attention (DeepSeek-V3 / Kimi-K2 shaped) is no start-time refusal: exact at the model level
    # (tests/integrations/megatron/test_mla.py); its unchecked settings are refused once the model is built
    mla = SimpleNamespace(model_type="deepseek_v3", kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64)
    assert megatron_setup_unsupported(DEFAULT_ENGINE, {**DEFAULT_MODEL, "hf_config": mla}) is None


@pytest.mark.parametrize("engine, model, says", [
    ({"dynamic_context_parallel": True}, {}, "dynamic context parallelism (dynamic_context_parallel=True)"),
    ({"dynamic_context_parallel": True, "pipeline_model_parallel_size": 1}, {}, "DynamicCPScheduler"),
    ({"router_replay": {"mode": "R3"}}, {}, "router_replay.mode=disabled"),
    ({"router_replay": {"mode": "R2"}}, {}, "per token of the ordinary rows"),
    ({}, {"mtp": {"enable": True}}, "multi-token prediction"),
    ({}, {"mtp": {"enable": True}}, "model.mtp.enable=False"),
    ({}, {"lora": {"rank": 8, "dropout": 0.1}}, "model.lora.dropout=0"),
    ({}, {"hf_config": SimpleNamespace(vision_config={})}, "vision-language"),
    ({}, {"hf_config": SimpleNamespace(vision_config={})}, "other than Qwen2.5-VL"),
    ({}, {"hf_config": SimpleNamespace(vision_config={}, model_type="qwen3_vl")}, "Qwen3-VL / Qwen3.5-VL"),
    ({}, {"hf_config": SimpleNamespace(vision_config={}, model_type="qwen2_5_vl")}, "tensor_model_parallel_size=2"),
    ({"tensor_model_parallel_size": 1}, {"hf_config": SimpleNamespace(vision_config={}, model_type="qwen2_5_vl")},
     "pipeline_model_parallel_size=2"),
    ({"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 2},
     {"hf_config": SimpleNamespace(vision_config={}, model_type="qwen2_5_vl")}, "context_parallel_size=2"),
    ({"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "vanilla_mbridge": True},
     {"hf_config": SimpleNamespace(vision_config={}, model_type="qwen2_5_vl")}, "vanilla_mbridge=False"),
    ({"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "use_fused_kernels": True},
     {"hf_config": SimpleNamespace(vision_config={}, model_type="qwen2_5_vl")}, "use_fused_kernels=False"),
    ({}, {"hf_config": SimpleNamespace(layer_types=["mamba", "attention"])}, "Mamba hybrid"),
])
def test_refusals_name_the_setting(engine, model, says):
    reason = megatron_setup_unsupported({**DEFAULT_ENGINE, **engine}, {**DEFAULT_MODEL, **model})
    assert reason is not None and says in reason, reason


def test_qwen25_vl_runs():
    """Qwen2.5-VL built by Megatron-Bridge, one rank per model, is no start-time refusal (exact through the engine:
    tests/integrations/megatron/test_engine_vlm.py)."""
    engine = {**DEFAULT_ENGINE, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    hf = SimpleNamespace(vision_config={}, model_type="qwen2_5_vl")
    assert megatron_setup_unsupported(engine, {**DEFAULT_MODEL, "hf_config": hf}) is None


def test_static_context_parallelism_runs():
    """Static CP (``context_parallel_size > 1``, with or without pipeline stages) is no start-time refusal (exact
    through the actor's and the critic's engines: tests/integrations/megatron/test_engine_cp.py)."""
    assert megatron_setup_unsupported({**DEFAULT_ENGINE, "context_parallel_size": 2}, DEFAULT_MODEL) is None
    engine = {**DEFAULT_ENGINE, "context_parallel_size": 2, "pipeline_model_parallel_size": 1}
    assert megatron_setup_unsupported(engine, DEFAULT_MODEL) is None


def test_gated_delta_net_hybrids_run():
    """Qwen3.5 / Qwen3-Next ("linear_attention" layers: megatron's GatedDeltaNet) are no start-time refusal: exact at
    the model level and through the engine (tests/integrations/megatron/test_gdn.py, test_engine_hybrid.py); any
    other sequence mixer is refused once the model is built."""
    hf = SimpleNamespace(model_type="qwen3_5_text", layer_types=["linear_attention", "full_attention"])
    assert megatron_setup_unsupported(DEFAULT_ENGINE, {**DEFAULT_MODEL, "hf_config": hf}) is None


def test_megatron_bridge_lora_runs():
    """Megatron-Bridge PEFT (``model.lora``) without dropout runs deduplicated; the FSDP key ``lora_rank`` is not
    read by verl's Megatron engine (it trains the whole model), so it is no refusal either."""
    assert megatron_setup_unsupported(DEFAULT_ENGINE, {**DEFAULT_MODEL, "lora": {"rank": 8, "dropout": 0.0}}) is None
    assert megatron_setup_unsupported(DEFAULT_ENGINE, {**DEFAULT_MODEL, "lora_rank": 16}) is None


def test_virtual_pipeline_and_fused_kernels_accepted():
    """Virtual pipeline stages and verl's fused kernels run (tests/integrations/megatron/test_engine_vpp.py)."""
    engine = {**DEFAULT_ENGINE, "virtual_pipeline_model_parallel_size": 2, "use_fused_kernels": True}
    assert megatron_setup_unsupported(engine, DEFAULT_MODEL) is None


def test_memory_logits_mode_refused():
    reason = megatron_setup_unsupported(DEFAULT_ENGINE, DEFAULT_MODEL, logits_optimization="memory")
    assert reason is not None and "logits_optimization=memory" in reason
    assert megatron_setup_unsupported(DEFAULT_ENGINE, DEFAULT_MODEL, logits_optimization="compute") is None


def test_attribute_configs():
    """verl's dataclass configs (attributes, not mappings) are read the same way."""
    engine = SimpleNamespace(**{**DEFAULT_ENGINE, "router_replay": SimpleNamespace(mode="R2")})
    assert "router replay" in megatron_setup_unsupported(engine, SimpleNamespace(**DEFAULT_MODEL))
