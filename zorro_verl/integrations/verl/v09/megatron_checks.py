"""The refusals of zorro's Megatron engine that need no built model (docs/design/megatron.md "The Megatron engine"):
read by the engine at start and by ``zorro-verl doctor`` from a composed config. Imports neither verl nor megatron."""

from __future__ import annotations

from typing import Optional

__all__ = ["megatron_setup_unsupported"]

#: The vision-language families zorro's Megatron engine runs (hf_config.model_type), built by Megatron-Bridge.
_VLM_TYPES = ("qwen2_5_vl",)


def _vlm_unsupported(get, engine_config, model_config, hf) -> Optional[str]:
    """Why zorro's Megatron engine cannot run this vision-language model (``hf.vision_config`` set), or None:
    Qwen2.5-VL built by Megatron-Bridge, one rank per model, runs (docs/design/megatron.md "Vision-language
    models")."""
    model_type = getattr(hf, "model_type", None)
    if model_type not in _VLM_TYPES:
        return (f"vision-language models on the Megatron engine other than Qwen2.5-VL (model_type={model_type!r}): "
                "Megatron-Bridge builds them as other modules (Qwen3-VL / Qwen3.5-VL: a deepstack vision tower "
                "feeding several decoder layers, their own language model and positions) that zorro's Megatron step "
                "does not run; run them with zorro in the FSDP engine or without zorro")
    if get(engine_config, "vanilla_mbridge", False):
        return ("vision-language models on the Megatron engine built by vanilla mbridge (vanilla_mbridge=True): "
                "zorro runs Megatron-Bridge's Qwen25VLModel only (verl's default builder); set vanilla_mbridge=False")
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        v = int(get(engine_config, key, 1) or 1)
        if v != 1:
            return (f"vision-language models on the Megatron engine with {key}={v}: zorro's vision tower, embedding "
                    f"merge and 3-D positions on the packed row are checked against the stock engine at {key}=1 "
                    f"only; set {key}=1 or run this job without zorro")
    if get(engine_config, "virtual_pipeline_model_parallel_size", None) not in (None, 1):
        return ("vision-language models on the Megatron engine with virtual pipeline stages: not checked; unset "
                "virtual_pipeline_model_parallel_size")
    if get(engine_config, "use_fused_kernels", False) or get(model_config, "use_fused_kernels", False):
        return ("vision-language models on the Megatron engine with use_fused_kernels=True: not checked against "
                "verl's fused vision-language forward; set use_fused_kernels=False")
    return None


def megatron_setup_unsupported(engine_config, model_config, logits_optimization: str = "none") -> Optional[str]:
    """Why a Megatron engine with these configs cannot run zorro's deduplicated forward, or None (the refusals that
    need no built model; also read by ``zorro-verl doctor`` from a composed config). ``engine_config``: verl's
    ``McoreEngineConfig`` (or a mapping with its keys); ``model_config``: verl's ``HFModelConfig`` or None;
    ``logits_optimization``: the zorro setting (``memory`` is refused on Megatron)."""
    def get(cfg, key, default=None):
        if cfg is None:
            return default
        return cfg.get(key, default) if hasattr(cfg, "get") and not hasattr(cfg, key) else getattr(cfg, key, default)

    if get(engine_config, "dynamic_context_parallel", False):
        return ("dynamic context parallelism (dynamic_context_parallel=True): verl's DynamicCPScheduler re-packs the "
                "ordinary rows into its own per-rank sequences and CP sizes, and zorro's packed row (one copy per "
                "unique prompt, split over a static CP group) is not wired to it; use static context parallelism "
                "(context_parallel_size > 1, dynamic_context_parallel=False) or run this job without zorro")
    router = get(engine_config, "router_replay", None)
    mode = get(router, "mode", "disabled") if router is not None else "disabled"
    if mode != "disabled":
        return (f"router replay (router_replay.mode={mode!r}): verl records and replays MoE routes "
                "(routed_experts) per token of the ordinary rows, and zorro's Megatron engine does not hand them to "
                "the packed row's routers yet (a deduplicated prompt token would replay its group's first row's "
                "routes, checked equal across the group: zorro_verl.packing.routes.packed_routes); set "
                "router_replay.mode=disabled or run this job without zorro")
    mtp = get(model_config, "mtp", None)
    if mtp is not None and get(mtp, "enable", False):
        return ("multi-token prediction (model.mtp.enable=True): megatron's MTP layers shift the ids and hidden "
                "states one token along the row, and on zorro's packed row a response's next token is not its "
                "neighbour (sibling responses follow one prompt); set model.mtp.enable=False or run this job "
                "without zorro")
    lora = get(model_config, "lora", None)
    if lora is not None and int(get(lora, "rank", 0) or 0) > 0:
        # Megatron-Bridge's PEFT (model.lora; verl's Megatron engine ignores the FSDP key lora_rank): its adapters are
        # token-wise linear maps beside the frozen layers, exact on the packed row; only their dropout is not
        dropout = float(get(lora, "dropout", 0.0) or 0.0)
        if dropout > 0:
            return (f"LoRA dropout (model.lora.dropout={dropout}) on the Megatron engine: a deduplicated prompt token "
                    "would draw one dropout mask instead of one per row; set model.lora.dropout=0")
    if logits_optimization == "memory":
        return ("logits_optimization=memory on the Megatron engine (its head is vocabulary parallel); use none or "
                "compute")
    hf = get(model_config, "hf_config", None)
    if hf is not None:
        if getattr(hf, "vision_config", None) is not None:
            reason = _vlm_unsupported(get, engine_config, model_config, hf)
            if reason is not None:
                return reason
        # gated delta-net hybrids (Qwen3.5, Qwen3-Next: "linear_attention" layers) run; the built model's mixers are
        # checked at initialize (zorro_verl.integrations.megatron.step: any other sequence mixer is refused there)
        layer_types = getattr(hf, "layer_types", None) or ()
        if any("mamba" in str(t) for t in layer_types):
            return ("Mamba hybrid models on the Megatron engine (zorro's Megatron step runs attention and gated "
                    "delta-net layers only; zorro runs Mamba hybrids in the FSDP engine)")
    return None
