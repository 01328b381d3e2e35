"""Every setting zorro refuses, in one list: where it is refused, why, and the module whose message says so.

This module is data: it imports nothing of zorro_verl, verl, megatron or OpenRLHF (any layer may import it). The
docs table ``docs/refusals.md`` is generated from :data:`REFUSALS` (``python -m zorro_verl.refusals >
docs/refusals.md``), and ``tests/test_refusals.py`` keeps the three in step: the page equals :func:`markdown`, each
record's ``phrase`` occurs in a string of its ``module`` (so a changed message breaks the test), and every refusal
message in the package's sources contains the phrase of a record (or is in :data:`EXEMPT`, with the reason).

**Adding a refusal:** raise it (or return it from an ``*_unsupported`` check) with a message that names the setting,
why, and the fix; then add a :class:`Refusal` below, under its integration, with a ``phrase`` copied from that
message (a distinctive piece of one string literal, no ``{}`` placeholder), and regenerate the page.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["Refusal", "REFUSALS", "EXEMPT", "WHERE", "WHEN", "markdown"]

#: The integrations, in the page's order, with what a refusal does there.
WHERE = {
    "verl 0.9 FSDP engine": "`fsdp_config.zorro.on_unsupported=raise` (default) raises; `warn` warns once per reason, "
                            "runs verl's stock forward (for a start-time refusal: every batch) and counts the batch in "
                            "`zorro/fallback_batches`. Per-batch checks are agreed by every DP rank first.",
    "verl 0.9 engines (FSDP and Megatron)": "Shared by both engines (batch layout, loss settings, registration, "
                                            "trainer hooks); raise / `warn` as the engine's own.",
    "verl 0.9 Megatron engine": "`megatron.zorro.on_unsupported`: raise, or warn once, run the stock engine and count "
                                "it. Checks that need no model run at engine start (also `zorro-verl doctor`).",
    "megatron-core GPTModel step": "`ValueError` from zorro's megatron step (`zorro_gpt_step`, `zorro_gpt_forward`, "
                                   "the core attention); the Megatron engine runs these checks once the model is "
                                   "built and treats a failure as a refusal.",
    "verl 0.7 actor": "`fsdp_config.zorro.on_unsupported`: raise, or warn once, run the legacy actor's stock forward "
                      "and count it.",
    "OpenRLHF": "`ZORRO_OPENRLHF_OPTIONS=on_unsupported=raise|warn`: raise, or warn once and run OpenRLHF's stock "
                "forward (counted). Argument checks run when the experience maker is built, before any rollout.",
    "TRL GRPOTrainer": "`ZorroGRPOTrainer(..., zorro={'on_unsupported': 'raise'})` or `enable(on_unsupported=...)`: "
                       "raise (default) a `ValueError`, or warn once per reason, run TRL's stock log-prob forward for "
                       "the call (a start-time refusal: every call) and count it in `zorro/fallbacks`. A TRL other "
                       "than the tested 1.16.x only warns under `warn`.",
    "standalone API": "`ValueError` from `DeduplicatedActor` or the packing functions.",
    "model step (transformers; every integration)": "`install_zorro` / `zorro_step` on a Hugging Face model, in "
                                                    "every integration above but Megatron; the engines call these "
                                                    "checks at start where they can.",
}
#: When the check runs.
WHEN = ("start", "model", "batch", "call")


@dataclass(frozen=True)
class Refusal:
    """One refused setting. ``key``: unique slug; ``where``: a key of :data:`WHERE`; ``setting``, ``why``: markdown
    for the table; ``when``: one of :data:`WHEN` (engine / actor start before the model, once the model is built,
    per batch, each call); ``module``: the dotted module whose message refuses it; ``phrase``: a distinctive
    substring of that message (within one string literal)."""

    key: str
    where: str
    setting: str
    why: str
    when: str
    module: str
    phrase: str


_V09 = "zorro_verl.integrations.verl.v09."
_MEG = "zorro_verl.integrations.megatron."
_HF = "zorro_verl.integrations.transformers."
_ORL = "zorro_verl.integrations.openrlhf."
_COMMON = "zorro_verl.integrations.verl.common"
_FSDP, _BOTH, _MCORE_ENGINE, _MCORE = ("verl 0.9 FSDP engine", "verl 0.9 engines (FSDP and Megatron)",
                                       "verl 0.9 Megatron engine", "megatron-core GPTModel step")
_TRLW = "TRL GRPOTrainer"
_TRL = "zorro_verl.integrations.trl.trainer"
_V07, _OPENRLHF, _API, _STEP = ("verl 0.7 actor", "OpenRLHF", "standalone API",
                                "model step (transformers; every integration)")
_DROPOUT_WHY = ("the ordinary forward draws one dropout mask per row, zorro computes a shared prompt once (one mask): "
                "the two would train different functions")
_ORDINARY_ROUTES = "routes are recorded per token of the ordinary rows; the packed row's routers do not get them yet"

REFUSALS: tuple[Refusal, ...] = (
    # ---------------------------------------------------------------- verl 0.9 FSDP engine
    Refusal("fsdp.ulysses_heads", _FSDP, "Ulysses SP > 1 with `Hq % sp != 0`",
            "every rank must get whole heads (verl's condition)", "model",
            "zorro_verl.attention.ulysses", "must divide the attention heads"),
    Refusal("fsdp.ulysses_mamba_heads", _FSDP, "Ulysses SP > 1 with Mamba-2 heads `num_heads % sp != 0`",
            "each rank runs whole heads of the scan", "model", _HF + "ssm", "must divide the Mamba-2 heads"),
    Refusal("fsdp.ulysses_kv_heads", _FSDP, "Ulysses SP > 1 where neither of `Hkv`, `sp` divides the other",
            "KV heads are repeated up to SP ranks or split over them, whole", "model",
            "zorro_verl.attention.ulysses", "must divide one another"),
    Refusal("fsdp.ulysses_delta_heads", _FSDP, "Ulysses SP > 1 with gated delta-net value heads `Hv % sp != 0`",
            "the delta-net's value heads carry its recurrent state; each rank runs whole heads", "model",
            _HF + "hybrid", "must divide the gated delta-net's value heads"),
    Refusal("fsdp.ulysses_batches_differ", _FSDP, "SP ranks holding different batches",
            "every SP rank builds the plan the exchanges rely on; always raises (a wiring error)", "batch",
            _V09 + "engine", "hold different batches"),
    Refusal("fsdp.vlm_fused", _FSDP, "multimodal batches with `use_fused_kernels`",
            "zorro's fused head path does not pass the images to the model", "batch",
            _V09 + "engine", "multimodal batches with use_fused_kernels=True"),
    Refusal("fsdp.mm_text_model", _FSDP, "multimodal inputs / 3-D position ids on a text-only model",
            "nothing would encode the images", "batch", _V09 + "engine",
            "multimodal inputs / 3-D position ids with a text-only model"),
    Refusal("fsdp.fused_temperature", _FSDP, "per-sample temperature tensors with `use_fused_kernels`",
            "verl's fused kernels take one float temperature (the stock fused path fails the same way)", "batch",
            _V09 + "engine", "per-sample temperature tensors with use_fused_kernels=True"),
    Refusal("fsdp.memory_temperatures", _FSDP, "`logits_optimization=memory` with per-sample temperatures",
            "the chunked head takes one temperature", "batch", _V09 + "engine",
            "per-sample temperatures with logits_optimization=memory"),
    Refusal("fsdp.memory_head", _FSDP, "`logits_optimization=memory` with a head that is not a `torch.nn.Linear` "
            "(e.g. LoRA on the LM head)", "the chunked head computes `F.linear(hidden, weight, bias)` and never calls "
            "the module", "model", _V09 + "engine", "logits_optimization=memory with this model's head"),
    Refusal("fsdp.qat_w4a4", _FSDP, "QAT W4A4 (`fsdp_config.qat.mode=w4a4`; W4A16 runs)",
            "its activation scale is observed over each micro-batch's tokens, which deduplication changes", "start",
            _V09 + "engine", "QAT W4A4 (fsdp_config.qat.mode=w4a4)"),
    Refusal("fsdp.topk_distillation", _FSDP, "top-k distillation (`distillation_use_topk`) with Ulysses SP, "
            "`use_fused_kernels`, `logits_optimization=memory` or multimodal batches", "zorro's distillation path "
            "runs the plain LM head on text batches (the loss needs the student's logits; verl's loss slices the "
            "teacher tensors by its own SP layout)", "batch", _V09 + "engine",
            "top-k distillation (distillation_use_topk=True) with"),
    Refusal("fsdp.position_ids", _FSDP, "position ids that do not count 0, 1, 2, ... along each row",
            "zorro recomputes positions on the packed row", "batch", _V09 + "engine",
            "position_ids that do not count 0, 1, 2, ... along each row"),
    Refusal("fsdp.sft_first_token_loss", _FSDP, "verl's SFT trainer: a sample whose first token is in the "
            "`loss_mask`", "nothing predicts it; verl's `sft_loss` rolls the flattened mask, so that bit lands on the "
            "previous sample's last position, a term that depends on which samples share a micro-batch", "batch",
            _V09 + "batching", "an SFT row whose first token is in the loss_mask"),
    Refusal("fsdp.sft_padded", _FSDP, "verl's SFT trainer with `data.pad_mode` other than `no_padding`",
            "the engine reads the jagged layout only", "batch", _V09 + "batching",
            "an SFT batch whose input_ids / loss_mask are not jagged"),
    Refusal("fsdp.sft_mask_lengths", _FSDP, "an SFT batch whose `loss_mask` rows differ in length from its "
            "`input_ids` rows", "not verl's SFT layout (one loss-mask entry per token)", "batch", _V09 + "batching",
            "an SFT batch whose loss_mask rows differ in length from its input_ids rows"),
    # ---------------------------------------------------------------- both verl 0.9 engines
    Refusal("v09.pad_mode", _BOTH, "`pad_mode` other than no-padding", "the engines read the jagged layout only",
            "batch", _V09 + "batching", "pad_mode other than no_padding"),
    Refusal("v09.distillation", _BOTH, "top-k distillation (`distillation_use_topk`, `distillation_only`) in the "
            "Megatron engine; `calculate_sum_pi_squared` in both", "outputs zorro does not produce there (the FSDP "
            "engine produces top-k distillation's)", "batch", _V09 + "batching", "distillation_use_topk"),
    Refusal("v09.reward_model", _BOTH, "a `zorro` key in the reward model's config (`reward.reward_model`, legacy "
            "`reward_model`)", "verl 0.9.1 runs a model reward model in an inference server (vLLM / SGLang, one "
            "request per rollout), not in a verl engine: no forward for zorro; raised by the trainer's constructor "
            "and `zorro-verl doctor`", "start", _V09 + "roles",
            "remove the zorro key from the reward model's config"),
    Refusal("v09.distillation_teacher", _BOTH, "a `zorro` key in the distillation config (`distillation`, "
            "`distillation.teacher_models.<key>`)", "verl 0.9.1 scores rollouts with the teacher in an inference "
            "server (`prompt_logprobs`, one request per rollout), not in a verl engine: no forward for zorro (the "
            "student's distillation loss runs in the actor's zorro engine); raised by the trainer's constructor and "
            "`zorro-verl doctor`", "start", _V09 + "roles", "remove the zorro key from the distillation config"),
    Refusal("v09.force_group_size", _BOTH, "`force_group_size > 1`", "an output layout zorro does not produce",
            "batch", _V09 + "batching", "force_group_size > 1"),
    Refusal("v09.seq_mean_token_sum_norm", _BOTH, "`loss_agg_mode=seq-mean-token-sum-norm` without "
            "`loss_scale_factor` (V1 trainer: nested response mask)", "the horizon is each micro-batch's longest "
            "response, so the loss depends on which rows share a micro-batch", "batch", _V09 + "losses",
            "loss_agg_mode=seq-mean-token-sum-norm with loss_scale_factor unset"),
    Refusal("v09.loss_modes", _BOTH, "`policy_loss.loss_mode` `clip_cov`, `kl_cov`, `geo_mean`",
            "tokens picked from, or means over, the micro-batch's rows", "batch", _V09 + "losses",
            "use another policy loss mode, e.g. vanilla"),
    Refusal("v09.bypass_batch_normalize", _BOTH, "`bypass_mode` with `rollout_is_batch_normalize`",
            "IS weights normalised per micro-batch", "batch", _V09 + "losses",
            "with rollout_correction.rollout_is_batch_normalize=true normalises the IS"),
    Refusal("v09.unverified_policy_loss", _BOTH, "a policy loss outside the allow-list (a custom "
            "`register_policy_loss`)", "zorro cannot know whether it depends on which rows share a micro-batch",
            "batch", _V09 + "losses", "is not a policy loss zorro has verified"),
    Refusal("v09.reregistered_policy_loss", _BOTH, "a verified policy-loss name re-registered with another function",
            "the allow-list holds verl's own functions only", "batch", _V09 + "losses",
            "is registered in verl's policy-loss registry as"),
    Refusal("v09.strategy", _BOTH, "zorro enabled with an actor / ref strategy other than `fsdp` / `fsdp2` / "
            "`megatron`", "no zorro engine for it; always raises at engine construction", "start",
            _V09 + "registration", "the zorro engines support"),
    Refusal("v09.critic_strategy", _BOTH, "a critic (value-model engine) config that enables zorro on a strategy "
            "other than `fsdp` / `fsdp2` / `megatron` (or `megatron` where megatron-core does not import)",
            "zorro's value-head engines are FSDP's and Megatron's; always raises at engine construction", "start",
            _V09 + "registration", "zorro's value-model (critic) engine runs on strategy"),
    Refusal("v09.critic_position_ids", _FSDP, "position ids that do not count 0, 1, 2, ... along each row, in "
            "the critic", "zorro recomputes positions on its packed row", "batch", _V09 + "value_engine",
            "position_ids that do not count 0, 1, 2, ... along each row"),
    Refusal("v09.critic_multimodal", _FSDP, "multimodal batches in the critic (value-head engine)",
            "zorro's value-head engine runs text value models only", "batch", _V09 + "value_engine",
            "zorro's value-head engine runs text value"),
    Refusal("v09.whole_groups_keep_minibatch", _BOTH, "`group_balance_mode=whole_groups` with verl's "
            "`keep_minibatch` balancing", "the whole-group placement decides mini-batch composition itself", "batch",
            _V09 + "balance", "group balance does not support keep_minibatch balancing"),
    # ---------------------------------------------------------------- verl 0.9 Megatron engine
    Refusal("megatron.dynamic_context_parallel", _MCORE_ENGINE, "dynamic context parallelism "
            "(`dynamic_context_parallel`)", "verl's DynamicCPScheduler re-packs the ordinary rows into its own "
            "per-rank sequences and CP sizes; zorro's packed row runs on a static CP group (`context_parallel_size > "
            "1` runs)", "start", _V09 + "megatron_checks",
            "dynamic context parallelism (dynamic_context_parallel=True)"),
    Refusal("megatron.context_parallel_moe", _MCORE_ENGINE, "MoE models under context parallelism",
            "megatron's expert dispatch over the CP shards has not been compared with the stock engine", "model",
            _V09 + "megatron_engine", "MoE models under context parallelism"),
    Refusal("megatron.router_replay", _MCORE_ENGINE, "router replay (`router_replay.mode != disabled`)",
            _ORDINARY_ROUTES, "start", _V09 + "megatron_checks", "router replay (router_replay.mode="),
    Refusal("megatron.router_replay_data", _MCORE_ENGINE, "batches with router-replay data (`routed_experts`, "
            "`enable_routing_replay`)", _ORDINARY_ROUTES, "batch", _V09 + "megatron_engine",
            "router replay data in the batch"),
    Refusal("megatron.mtp", _MCORE_ENGINE, "multi-token prediction (`model.mtp.enable`)",
            "MTP shifts ids and hidden states one token along the row; on the packed row a response's next token is "
            "not its neighbour", "start", _V09 + "megatron_checks", "multi-token prediction (model.mtp.enable=True)"),
    Refusal("megatron.lora_dropout", _MCORE_ENGINE, "LoRA dropout (`model.lora.dropout > 0`)", _DROPOUT_WHY, "start",
            _V09 + "megatron_checks", "LoRA dropout (model.lora.dropout="),
    Refusal("megatron.memory", _MCORE_ENGINE, "`logits_optimization: memory`",
            "megatron's head is vocabulary parallel (use `none` / `compute`)", "start", _V09 + "megatron_checks",
            "logits_optimization=memory on the Megatron engine"),
    Refusal("megatron.vlm", _MCORE_ENGINE, "vision-language models other than Qwen2.5-VL built by Megatron-Bridge "
            "at TP = PP = CP = 1 (Qwen3-VL / Qwen3.5-VL, vanilla mbridge's build, tensor / pipeline / context "
            "parallelism, virtual pipeline stages, `use_fused_kernels`); Qwen2.5-VL runs deduplicated",
            "other families are other modules (a deepstack vision tower feeding several decoder layers) that "
            "zorro's Megatron step does not run; the Qwen2.5-VL path (vision tower once per unique image, the packed "
            "row's 3-D positions) is checked against the stock engine on one rank per model only (the FSDP engine "
            "runs all Qwen-VL families)", "start", _V09 + "megatron_checks",
            "vision-language models on the Megatron engine"),
    Refusal("megatron.mamba", _MCORE_ENGINE, "Mamba hybrid models (`layer_types` with `mamba`)",
            "zorro's Megatron step runs attention and gated delta-net layers only (gated delta-net hybrids such as "
            "Qwen3.5 run; the FSDP engine runs Mamba hybrids)", "start", _V09 + "megatron_checks",
            "Mamba hybrid models on the Megatron engine"),
    Refusal("megatron.per_token_loss", _MCORE_ENGINE, "`calculate_per_token_loss` with MoE router losses on "
            "(aux / global aux / z loss)", "megatron's per-token regime scales the router's losses by the "
            "micro-batch's token count; not proved for zorro's multiplicity-weighted statistics (dense models and "
            "routers without losses run the regime exactly)", "model", _V09 + "megatron_engine",
            "calculate_per_token_loss=True with MoE router losses on"),
    Refusal("megatron.legacy_fused", _MCORE_ENGINE, "`use_fused_kernels` with verl's legacy fused forward "
            "(megatron-core without `output_processor`)", "it replaces `GPTModel.forward`", "model",
            _V09 + "megatron_engine", "verl's legacy fused forward"),
    Refusal("megatron.vlm_build", _MCORE_ENGINE, "a vision-language model built as another class than "
            "Megatron-Bridge's `Qwen25VLModel`", "zorro's Megatron step runs that class's forward only", "model",
            _V09 + "megatron_engine", "on the Megatron engine: zorro runs Megatron-Bridge's Qwen25VLModel only"),
    Refusal("megatron.multimodal", _MCORE_ENGINE, "multimodal inputs / 3-D position ids on a text-only model",
            "nothing would encode the images", "batch", _V09 + "megatron_engine",
            "multimodal inputs / 3-D position ids on the Megatron engine"),
    Refusal("megatron.temperatures", _MCORE_ENGINE, "per-sample temperatures", "zorro's Megatron head takes one "
            "float", "batch", _V09 + "megatron_engine", "per-sample temperatures on the Megatron engine"),
    Refusal("megatron.position_ids", _MCORE_ENGINE, "position ids that do not count 0, 1, 2, ... along each row",
            "zorro recomputes positions on the packed row; checked before the ranks agree", "batch",
            _V09 + "megatron_engine", "position_ids that do not count 0, 1, 2, ... along each row"),
    # ---------------------------------------------------------------- megatron-core GPTModel step
    Refusal("mcore.value_head", _MCORE, "a value model (the Megatron critic) whose `output_layer` is not a "
            "per-token `Linear(H, 1)`", "zorro's value step runs verl's value head (`LinearForLastLayer`) at every "
            "packed row", "model", _MEG + "step", "whose output_layer is a per-token value head"),
    Refusal("mcore.dropout", _MCORE, "`hidden_dropout > 0`, `attention_dropout > 0` in training",
            "a deduplicated prompt token would draw one dropout mask instead of one per copy (eval mode runs)",
            "model", _MEG + "step", "a deduplicated prompt token would draw one dropout mask"),
    Refusal("mcore.jitter", _MCORE, "`moe_input_jitter_eps` in training", "the router's per-token multiplicative "
            "noise would be drawn once per shared prompt token", "model", _MEG + "step",
            "the MoE router's per-token multiplicative noise"),
    Refusal("mcore.attention_dropout", _MCORE, "attention dropout in the core attention in training",
            "as above, in the attention probabilities", "call", _MEG + "attention",
            "attention_dropout: expected 0 with zorro in training"),
    Refusal("mcore.mask", _MCORE, "an attention mask or a non-causal mask type with a plan",
            "the plan is the mask; split attention is causal", "call", _MEG + "attention",
            "expected AttnMaskType.causal"),
    Refusal("mcore.attention_bias", _MCORE, "attention biases", "not part of the split attention", "call",
            _MEG + "attention", "attention biases are not supported"),
    Refusal("mcore.keywords", _MCORE, "unknown core-attention keywords", "they may change the attention's math",
            "call", _MEG + "attention", "expected none beyond megatron's"),
    Refusal("mcore.context_parallel_shard", _MCORE, "a model whose `context_parallel_size` differs from the "
            "plan's CP shard", "each rank must run its own share of the packed row", "call", _MEG + "attention",
            "the zorro params a CP shard of"),
    Refusal("mcore.context_parallel_local", _MCORE, "non-zorro calls of megatron's local attention under context "
            "parallelism", "it has no CP exchange (zorro calls carry their own)", "call", _MEG + "attention",
            "which has no context-parallel exchange: only zorro calls"),
    Refusal("mcore.context_parallel_mla", _MCORE, "context parallelism with multi-latent attention",
            "MLA positions its RoPE inside its projections; not wired to the CP layout", "model", _MEG + "step",
            "expected 1 with zorro on multi_latent_attention"),
    Refusal("mcore.context_parallel_moe", _MCORE, "context parallelism with MoE router statistics on",
            "the per-token multiplicities are not wired to the CP layout", "call", _MEG + "step",
            "multiplicities are not wired to the CP layout yet"),
    Refusal("mcore.context_parallel_backend", _MCORE, "attention backends other than `flash_copyfree` / `flash` / "
            "`sdpa` / `eager` under context parallelism (`flex`)", "the CP attention all-gathers K/V and runs "
            "varlen flash calls over the visible keys or one dense masked call per rank on them", "call",
            "zorro_verl.attention.context_parallel", "under context parallelism, got"),
    Refusal("mcore.context_parallel_varlen_features", _MCORE, "windows, chunks or sinks with the varlen (flash) "
            "CP attention", "its flash calls are cut by node, not by position rule; the dense `sdpa` CP call takes "
            "them", "call", "zorro_verl.attention.context_parallel", "under context parallelism runs varlen flash"),
    Refusal("mcore.softmax_type", _MCORE, "`softmax_type` other than vanilla (sinks)", "not wired on Megatron",
            "call", _MEG + "attention", "softmax_type: expected 'vanilla' with zorro"),
    Refusal("mcore.window", _MCORE, "sliding windows (`window_size`)", "not wired on Megatron", "call",
            _MEG + "attention", "window_size: expected None with zorro"),
    Refusal("mcore.position_embedding", _MCORE, "position embeddings other than `rope` (MLA has its own; `mrope` "
            "in Megatron-Bridge's Qwen2.5-VL only)", "the step positions RoPE by the plan's positions", "model",
            _MEG + "step", "yarn / learned positions are not wired yet"),
    Refusal("mcore.vlm_parallel", _MCORE, "a vision-language model under tensor / pipeline / context parallelism "
            "or virtual pipeline stages", "the vision tower, the embedding merge and the packed row's 3-D positions "
            "are checked on one rank per model only", "model", _MEG + "vlm",
            "with a vision-language model on zorro's Megatron engine"),
    Refusal("mcore.vlm_value", _MCORE, "a vision-language value model (critic)", "not wired to the step", "model",
            _MEG + "step", "a vision-language value model is not wired"),
    Refusal("mcore.mtp", _MCORE, "multi-token prediction (`mtp_num_layers`)", "MTP rolls the row one token; the "
            "packed row's neighbours are not a response's next tokens", "model", _MEG + "step",
            "mtp_num_layers: expected 0/None with zorro"),
    Refusal("mcore.fp8", _MCORE, "`fp8` / `fp4`", "amax statistics over the micro-batch's tokens, which "
            "deduplication changes", "model", _MEG + "step", "low-precision scaling"),
    Refusal("mcore.routing_replay", _MCORE, "`moe_enable_routing_replay`", _ORDINARY_ROUTES, "model", _MEG + "step",
            "replayed routes are set per token of the ordinary rows"),
    Refusal("mcore.mixer", _MCORE, "sequence mixers other than self-attention, MLA and megatron's "
            "`GatedDeltaNet`", "they would mix the packed row's segments", "model", _MEG + "step",
            "a sequence mixer zorro"),
    Refusal("mcore.gdn_install", _MCORE, "gated delta-nets that are not zorro's (`ZorroGatedDeltaNet`)",
            "their recurrence would run across the packed row's segments", "model", _MEG + "step",
            "a gated delta-net without zorro's packed"),
    Refusal("mcore.gdn_inference", _MCORE, "a gated delta-net called with an inference context",
            "zorro runs training / log-prob forwards without a cache", "call", _MEG + "gdn",
            "zorro gated delta-net: got an inference context"),
    Refusal("mcore.gdn_context_parallel", _MCORE, "context parallelism in a gated delta-net",
            "no context-parallel exchange yet", "call", _MEG + "gdn", "zorro gated delta-net: context_parallel_size"),
    Refusal("mcore.gdn_shape", _MCORE, "a gated delta-net input that is not the packed row",
            "the plan describes the packed row only", "call", _MEG + "gdn",
            "zorro gated delta-net: expected the packed row"),
    Refusal("mcore.mla_install", _MCORE, "MLA layers that are not zorro's (`ZorroMLA`)",
            "their RoPE would run by packed index", "model", _MEG + "step", "without zorro's RoPE positions"),
    Refusal("mcore.mla_rope_fusion", _MCORE, "MLA with `apply_rope_fusion`", "megatron's fused MLA RoPE kernels "
            "index cos / sin by token index (unchecked with zorro)", "model", _MEG + "step",
            "apply_rope_fusion: expected False with zorro on multi_latent_attention"),
    Refusal("mcore.mla_interleaved", _MCORE, "MLA with `rotary_interleaved`", "its rotate-half does not index the "
            "packed row's layout", "model", _MEG + "step",
            "rotary_interleaved: expected False with zorro on multi_latent_attention"),
    Refusal("mcore.mla_cache", _MCORE, "MLA with `cache_mla_latents` / `mla_down_proj_fusion`",
            "an inference cache / TE's fused down projection, not checked with zorro", "model", _MEG + "step",
            "an inference cache / Transformer Engine's fused down projection"),
    Refusal("mcore.memory", _MCORE, "`logits_optimization='memory'`", "the head is vocabulary parallel", "call",
            _MEG + "step", "'memory' is not supported on megatron yet"),
    Refusal("mcore.temperature", _MCORE, "per-row temperature tensors", "not wired on Megatron yet", "call",
            _MEG + "step", "per-row tensors are not wired"),
    Refusal("mcore.pipeline_split", _MCORE, "`zorro_gpt_step` on one pipeline stage",
            "it runs a whole model; use `zorro_gpt_forward` / `zorro_gpt_logprobs` per stage", "call",
            _MEG + "step", "zorro_gpt_step runs a whole model"),
    Refusal("mcore.moe_replay", _MCORE, "MoE routing replay (router check)", _ORDINARY_ROUTES, "model",
            _MEG + "moe", "routes are recorded and replayed per token of the ordinary rows"),
    Refusal("mcore.moe_force_balance", _MCORE, "`moe_router_force_load_balancing`", "random logits drawn in the "
            "micro-batch's token shape", "model", _MEG + "moe", "random logits are drawn in the micro-batch's"),
    Refusal("mcore.moe_force_biased", _MCORE, "`moe_router_force_biased`", "a random bias drawn in the "
            "micro-batch's token shape", "model", _MEG + "moe", "a random bias is drawn in the"),
    Refusal("mcore.moe_jitter", _MCORE, "`moe_input_jitter_eps` (router check)", "jitter noise drawn in the "
            "micro-batch's token shape", "model", _MEG + "moe", "the jitter noise is drawn in the"),
    Refusal("mcore.moe_sinkhorn", _MCORE, "sinkhorn / quantile balancing", "routes normalised over the "
            "micro-batch's tokens", "model", _MEG + "moe", "routing normalises the routes over the micro-batch's"),
    Refusal("mcore.moe_seq_aux_loss", _MCORE, "`seq_aux_loss`", "per ordinary sequence, and which tokens form a "
            "sequence is the layout's", "model", _MEG + "moe", "the sequence-level loss is per ordinary sequence"),
    Refusal("mcore.moe_token_dropping", _MCORE, "capacity factors / `moe_token_dropping`", "which tokens an expert "
            "drops depends on the micro-batch's token count and order", "model", _MEG + "moe",
            "the tokens an expert drops depend on"),
    Refusal("mcore.moe_router_class", _MCORE, "router statistics on a router class other than `TopKRouter`",
            "zorro counts them by multiplicity on megatron-core's `TopKRouter` only", "model", _MEG + "moe",
            "zorro counts them only on megatron-core's TopKRouter"),
    Refusal("mcore.moe_recompute", _MCORE, "recomputation covering the router (`full`, selective `moe`) with a "
            "router statistic on", "megatron computes the statistics again in backward, outside the zorro forward",
            "model", _MEG + "moe", "are computed again in the backward recomputation"),
    # ---------------------------------------------------------------- verl 0.7 actor
    Refusal("v07.ulysses", _V07, "Ulysses SP > 1", "the legacy actor slices rows itself; only the 0.9 engine runs "
            "zorro under SP", "start", _COMMON, "Ulysses sequence parallel > 1 in the verl 0.7 legacy actor"),
    Refusal("v07.vlm", _V07, "vision-language models (also OpenRLHF's actor)", "it does not hand images and 3-D "
            "positions to zorro's packed forward (the 0.9 engine runs VLMs)", "start", _COMMON,
            "vision-language models in this actor"),
    Refusal("v07.fused", _V07, "`use_fused_kernels`", "not wired in the legacy actor", "start",
            "zorro_verl.integrations.verl.v07.actor", "fused kernels (set actor_rollout_ref.model.use_fused_kernels"),
    Refusal("v07.prefix_grouper", _V07, "`use_prefix_grouper`", "verl's own prefix sharing; zorro replaces it",
            "start", "zorro_verl.integrations.verl.v07.actor", "use_prefix_grouper (verl's own prefix sharing"),
    Refusal("v07.sum_pi_squared", _V07, "`calculate_sum_pi_squared`", "an output zorro does not produce", "start",
            "zorro_verl.integrations.verl.v07.actor", "calculate_sum_pi_squared=True"),
    Refusal("v07.memory", _V07, "`logits_optimization=memory`", "not offered by the legacy actor (`none` / "
            "`compute`)", "start", "zorro_verl.integrations.verl.v07.actor",
            "logits_optimization=memory in the legacy actor"),
    Refusal("v07.multimodal", _V07, "multimodal inputs, 3-D position ids (mrope)", "VLMs do not run here", "batch",
            "zorro_verl.integrations.verl.v07.actor", "3-D position ids (mrope)"),
    Refusal("v07.multimodal_inputs", _V07, "`multi_modal_inputs` in a micro-batch", "VLMs do not run here", "batch",
            "zorro_verl.integrations.verl.v07.actor", "multimodal inputs"),
    Refusal("v07.engine_workers", _V07, "zorro enabled with `trainer.use_legacy_worker_impl=disable`",
            "the new engine workers never build the legacy actor; raised where they wrap the engine config", "start",
            "zorro_verl.integrations.verl.v07.config", "verl 0.7 is building its new engine workers"),
    # ---------------------------------------------------------------- OpenRLHF
    Refusal("openrlhf.ring_attention", _OPENRLHF, "ring attention (`--ds.ring_attn_size > 1`, `ring_attn_group`)",
            "sequences are sliced across ranks", "start", _ORL + "actor", "ring attention (--ds.ring_attn_size > 1)"),
    Refusal("openrlhf.tensor_parallel", _OPENRLHF, "DeepSpeed tensor parallelism (`--ds.tensor_parallel_size > 1`, "
            "AutoTP modules)", "heads and vocabulary are sharded", "start", _ORL + "actor",
            "DeepSpeed tensor parallelism (--ds.tensor_parallel_size > 1)"),
    Refusal("openrlhf.vlm", _OPENRLHF, "vision-language models", "3-D position ids / multimodal inputs are not "
            "handed to zorro's packed forward", "model", _ORL + "actor",
            "vision-language models (3-D position ids / multimodal inputs)"),
    Refusal("openrlhf.multimodal", _OPENRLHF, "multimodal inputs in a call", "as above", "call", _ORL + "actor",
            "multimodal inputs"),
    Refusal("openrlhf.lora_dropout", _OPENRLHF, "LoRA dropout (`--ds.lora.dropout > 0`)", _DROPOUT_WHY, "start",
            _ORL + "actor", "LoRA dropout > 0 (--ds.lora.dropout"),
    Refusal("openrlhf.aux_loss_coef", _OPENRLHF, "the MoE load-balancing loss (`--actor.aux_loss_coef > 0`)",
            "the ordinary loss counts every prompt once per sample", "start", _ORL + "actor",
            "the MoE load-balancing loss (--actor.aux_loss_coef > 0)"),
    Refusal("openrlhf.aux_loss_output", _OPENRLHF, "reading `output.aux_loss`", "the deduplicated forward does not "
            "produce it", "call", _ORL + "actor", "output.aux_loss (the MoE load-balancing loss) is not produced"),
    Refusal("openrlhf.no_action_mask", _OPENRLHF, "calls without `action_mask` (full logits or per-token log-probs: "
            "SFT, DPO)", "zorro computes the head at response-predicting rows only", "call", _ORL + "actor",
            "a call without action_mask"),
    Refusal("openrlhf.logits", _OPENRLHF, "reading `output.logits`", "none are computed", "call", _ORL + "actor",
            "only and returns no logits"),
    Refusal("openrlhf.version", _OPENRLHF, "an OpenRLHF release outside the tested one(s) (`version_check=warn` "
            "runs anyway)", "the hooks replace whole methods of the tested release", "start", _ORL + "boot",
            "is tested with that release only"),
    # ---------------------------------------------------------------- TRL GRPOTrainer
    Refusal("trl.version", _TRLW, "a TRL other than 1.16.x", "the seam (`GRPOTrainer._get_per_token_logps_and_"
            "entropies`) is a private method; only the tested version is known to call it as zorro expects", "start",
            _TRL, "is not the tested version"),
    Refusal("trl.loss_type", _TRLW, "a `loss_type` outside TRL 1.16's eight (grpo, bnpo, dr_grpo, dapo, cispo, sapo, "
            "vespo, luspo)", "each loss type is tested equal to stock; a new one is unverified", "start", _TRL,
            "is not one of the tested loss types"),
    Refusal("trl.liger", _TRLW, "`use_liger_kernel=True`", "Liger's layer kernels replace the model's own; zorro's "
            "packed forward is not tested with them", "start", _TRL, "which zorro's packed forward is not tested"),
    Refusal("trl.group_order_loss", _TRLW, "`micro_batch_order='groups'` with `loss_type='bnpo'`",
            "bnpo divides by the micro-batch's token count: regrouping rows changes the step's gradient", "start",
            _TRL, "its normaliser is "),
    Refusal("trl.group_order_steps", _TRLW, "`micro_batch_order='groups'` with `steps_per_generation != "
            "gradient_accumulation_steps`", "the order would move rows between optimizer steps", "start", _TRL,
            "the order would move rows between"),
    Refusal("trl.group_order_entropy", _TRLW, "`micro_batch_order='groups'` with `entropy_coef != 0` or "
            "`top_entropy_quantile < 1`", "both are computed per micro-batch", "start", _TRL,
            "are computed per micro-batch, so regrouping"),
    Refusal("trl.aux_loss", _TRLW, "the MoE router auxiliary loss (`output_router_logits`)",
            "it is computed per token of the ordinary rows", "call", _TRL, "the MoE router auxiliary loss"),
    Refusal("trl.media_family", _TRLW, "multimodal inputs of families other than the Qwen2-VL one "
            "(`pixel_attention_mask`, `spatial_shapes`, `num_tiles`, `image_sizes`, `token_type_ids`, "
            "`image_position_ids`: InternVL, LFM2-VL, LLaVA-style, Gemma, ...)", "zorro's media plan takes the "
            "Qwen2-VL family's images (`pixel_values` + `image_grid_thw` + `num_images`)", "call", _TRL,
            "of this model family are not supported"),
    Refusal("trl.media_text_model", _TRLW, "multimodal inputs with a text-only model", "nothing would encode the "
            "images", "call", _TRL, "with a text-only model"),
    Refusal("trl.media_vision_tower", _TRLW, "a vision-language model outside the Qwen2-VL family (no "
            "`vision_config.spatial_merge_size`)", "zorro's media plan is written for that family's placeholders "
            "and grids", "call", _TRL, "vision tower is not of the Qwen2-VL family"),
    Refusal("trl.media_counts", _TRLW, "`pixel_values` without `image_grid_thw` and `num_images`", "the rows' "
            "images cannot be told apart", "call", _TRL, "pixel_values without image_grid_thw and num_images"),
    Refusal("trl.media_dropped", _TRLW, "`mm_token_type_ids` that disagree with the placeholder tokens (TRL drops "
            "a batch's images when a completion truncated an image's placeholders)", "the placeholders then run as "
            "text, which zorro's media plan does not reproduce", "call", _TRL,
            "mm_token_type_ids disagree with the image / video placeholder"),
    # ---------------------------------------------------------------- standalone API
    Refusal("api.multimodal_keys", _API, "multimodal keys in a `DeduplicatedActor` batch", "it runs text batches and "
            "would drop them; use the lower-level path", "call", "zorro_verl.api.actor",
            "are not taken by DeduplicatedActor"),
    Refusal("api.placeholders", _API, "image / video placeholder tokens in a `DeduplicatedActor` batch",
            "they would be embedded as text", "call", "zorro_verl.api.actor", "DeduplicatedActor takes no media"),
    Refusal("api.position_ids_3d", _API, "3-D position ids to `build_plan`", "text plans take 1-D positions; "
            "`build_media_plan` takes 3-D ones", "call", "zorro_verl.packing.plan",
            "3-D (multimodal/mrope) position ids are not supported"),
    # ---------------------------------------------------------------- model step (transformers)
    Refusal("step.layer_types", _STEP, "`config.layer_types` other than `full_attention`, `sliding_attention`, "
            "`attention`, `chunked_attention`, `linear_attention`, `mamba`, `conv`, `mlp`, `moe`, `hybrid`",
            "such layers would let a response see its siblings", "model", _HF + "install",
            "do not mix the sequence through zorro"),
    Refusal("step.hybrid_layer_unknown", _STEP, "`hybrid` layers other than Zamba's / Zamba2's (a shared attention "
            "block feeding a Mamba layer) and Falcon-H1's (attention beside a Mamba-2 mixer)",
            "a response would see its siblings", "model", _HF + "ssm",
            "is not a hybrid layer zorro knows"),
    Refusal("step.no_attention_interface", _STEP, "models whose attention does not dispatch through transformers' "
            "`AttentionInterface` (e.g. Falcon, GPT-J, BLOOM, MPT, RWKV, RecurrentGemma)", "the module computes "
            "attention itself; transformers cannot set `attn_implementation` on it, so zorro cannot reach it",
            "model", _HF + "install", "its attention does not dispatch through transformers' AttentionInterface"),
    Refusal("step.mixer_bypasses", _STEP, "a sequence mixer that runs beside the attention interface on a model whose "
            "attention is pluggable", "the probe counts fewer zorro attention calls than attention layers; the module "
            "named would mix the packed row unseparated", "model", _HF + "install",
            "mixes the sequence without transformers' AttentionInterface"),
    Refusal("step.model_mask", _STEP, "a model that builds its attention's mask itself (e.g. Doge's dynamic mask, "
            "GLM-MoE-DSA's sparse index mask)", "a learned or content-dependent mask zorro cannot reproduce on the "
            "packed row", "model", _HF + "install", "hands its attention a mask it builds itself"),
    Refusal("step.own_positions", _STEP, "a model whose own positions for a row are not 0, 1, 2, ... (RoBERTa-style "
            "embeddings: CamemBERT, XLM-R, Data2Vec-Text, ...)", "zorro numbers every row from 0; checked by the "
            "install probe (one row with and without `position_ids`)", "model", _HF + "install",
            "numbers a row's tokens other than 0, 1, 2, ..."),
    Refusal("step.packed_row_reader", _STEP, "a layer whose output on zorro's packed row differs from its output on "
            "each row alone (the install probe: it reads the packed length, packed indices or a mask over the packed "
            "row)", "the deduplicated forward would train a different function", "model", _HF + "install",
            "zorro's packed row than on each row alone"),
    Refusal("step.chunk_mismatch", _STEP, "a `chunked_attention` layer whose attention module's chunk differs from "
            "`config.attention_chunk_size` (no `config` / `layer_idx` on the module)",
            "the ordinary forward's mask follows the layer types, zorro reads the chunk from the module",
            "model", _HF + "install", "config.attention_chunk_size; zorro reads"),
    Refusal("step.chunk_size_missing", _STEP, "a `chunked_attention` layer with `config.attention_chunk_size = None`",
            "the ordinary mask needs the chunk size", "call", _HF + "attention",
            "is a chunked_attention layer but config.attention_chunk_size is None"),
    Refusal("step.attention_dropout", _STEP, "`config.attention_dropout > 0`", "zorro's attention has no dropout",
            "model", _HF + "install", "zorro's attention has no dropout"),
    Refusal("step.bidirectional", _STEP, "`use_bidirectional_attention`, non-causal attention calls",
            "split attention is causal only", "model", _HF + "install", "split attention is causal only"),
    Refusal("step.window_mismatch", _STEP, "a layer whose sliding window differs from its layer type's",
            "the ordinary forward's mask follows the layer types, zorro follows the call", "model", _HF + "install",
            "but its layer type gives"),
    Refusal("step.attention_mask", _STEP, "an attention mask reaching the zorro attention", "the plan carries the "
            "structure; a mask means the model built one", "call", _HF + "attention",
            "got an attention_mask; the model built a mask"),
    Refusal("step.attention_dropout_call", _STEP, "attention dropout in training mode", "as above", "call",
            _HF + "attention", "in training mode is not supported (RL"),
    Refusal("step.non_causal_call", _STEP, "a non-causal attention module or call", "split attention is causal "
            "only", "call", _HF + "attention", "attends bidirectionally (is_causal=False"),
    Refusal("step.output_attentions", _STEP, "`output_attentions=True`", "zorro never materialises attention "
            "weights", "call", _HF + "attention", "output_attentions=True is not supported"),
    Refusal("step.unknown_kwargs", _STEP, "attention keywords zorro does not know", "they may change the "
            "attention's math", "call", _HF + "attention", "so they are refused rather than ignored"),
    Refusal("step.per_token_noise", _STEP, "per-token random ops in training (`router_jitter_noise`, hidden / "
            "residual / embedding dropouts)", "drawn once per shared prompt token instead of once per row", "call",
            _HF + "step", "a per-token random op"),
    Refusal("step.value_v_head", _STEP, "a value model loaded as trl's `AutoModelForCausalLMWithValueHead` "
            "(`v_head`)", "zorro's value step reads `*ForTokenClassification` models (`score`, num_labels=1)",
            "model", _HF + "step", "a trl AutoModelForCausalLMWithValueHead"),
    Refusal("step.value_head_layout", _STEP, "a value model whose head is not a `Linear(H, 1)` `score`",
            "the value step picks one value per token from that head", "model", _HF + "step",
            "expected a *ForTokenClassification model with num_labels=1"),
    Refusal("step.memory_temperatures", _STEP, "per-row temperatures with the `memory` mode (or a head function)",
            "the head takes one temperature", "call", _HF + "step",
            "per-row temperatures with logits_optimization='memory'"),
    Refusal("step.softcap_head_fn", _STEP, "`memory` mode / verl's fused kernels on a model with "
            "`final_logit_softcapping`", "the head functions return log-probs where the model would soft-cap "
            "logits", "model", _HF + "step", "soft-caps its logits after the head"),
    Refusal("step.head_output_changed", _STEP, "`memory` mode / fused kernels on a model that transforms its head's "
            "output", "the head functions need the head's output handed through as the logits", "call",
            _HF + "step", "the model transformed its head's output"),
    Refusal("step.memory_non_linear_head", _STEP, "`memory` mode with a head that is not a `torch.nn.Linear` "
            "(e.g. LoRA on the head)", "the chunked head never calls the module", "call", "zorro_verl.logprob.response",
            "expected a torch.nn.Linear head"),
    Refusal("step.lora_dropout", _STEP, "LoRA dropout > 0 (PEFT)", _DROPOUT_WHY, "model", _HF + "lora",
            "LoRA dropout > 0 (adapter"),
    Refusal("step.alora", _STEP, "activated LoRA (aLoRA, `alora_invocation_tokens`)", "PEFT finds the invocation "
            "per input row; the packed row holds several prompts", "model", _HF + "lora", "activated LoRA (aLoRA"),
    Refusal("step.prompt_learning", _STEP, "PEFT prompt learning (prompt tuning, prefix tuning, p-tuning)",
            "virtual tokens per input row have no place in the packed row", "model", _HF + "lora",
            "PEFT prompt learning"),
    Refusal("step.hybrid_layers", _STEP, "`linear_attention` layers zorro cannot find (no `layers` list)",
            "they would run over the packed row unseparated", "model", _HF + "hybrid", "has no `layers` list"),
    Refusal("step.hybrid_no_module", _STEP, "`linear_attention` layers without a `linear_attn` module",
            "zorro wraps only the linear-attention modules it knows", "model",
            _HF + "hybrid", "is a linear_attention layer without a `linear_attn` module"),
    Refusal("step.hybrid_unknown", _STEP, "linear-attention modules other than the gated delta-nets of Qwen3.5 / "
            "Qwen3-Next / OLMo-hybrid and MiniMax's lightning attention",
            "a response would see its siblings' state", "model", _HF + "hybrid",
            "is not a gated delta-net zorro knows"),
    Refusal("step.short_conv_unknown", _STEP, "`conv` layers whose `conv` module is not LFM2's short gated conv",
            "a response would see its siblings' conv inputs", "model", _HF + "mixers",
            "whose `conv` module zorro does not know"),
    Refusal("step.short_conv_layers", _STEP, "`conv` layers zorro cannot find (no `layers` list)",
            "they would run over the packed row unseparated", "model", _HF + "mixers",
            "layers but the decoder has no `layers` list"),
    Refusal("step.short_conv_ulysses_channels", _STEP, "LFM2 short convs under Ulysses SP not dividing `hidden_size` "
            "(also refused at FSDP engine initialisation)", "each rank runs whole channels of the conv", "call",
            _HF + "mixers", "must divide the short conv's channels"),
    Refusal("step.lightning_ulysses_heads", _STEP, "MiniMax lightning attention under Ulysses SP not dividing its "
            "heads (also refused at FSDP engine initialisation)", "each rank runs whole heads of the recurrence",
            "call", _HF + "mixers", "must divide the lightning attention's heads"),
    Refusal("step.mamba_unknown", _STEP, "`mamba` layers whose mixer is neither a Mamba-2 mixer of Mamba2 / Bamba / "
            "Granite 4 hybrid / Nemotron-H / Zamba2 / Falcon-H1 nor a Mamba v1 mixer of Mamba / FalconMamba / Jamba / "
            "Zamba",
            "a response would see its siblings' state",
            "model", _HF + "ssm", "running it over the packed row would let a response see its siblings"),
    Refusal("step.mamba_layers", _STEP, "`mamba` layers zorro cannot find (no `layers` list, no `mamba` / `mixer` "
            "module)", "they would run over the packed row unseparated", "model", _HF + "ssm",
            "has mamba layers but the decoder has no"),
    Refusal("step.mamba_mixer_missing", _STEP, "a `mamba` layer without a `mamba` / `mixer` module",
            "as above", "model", _HF + "ssm", "is a mamba layer without a `mamba` / `mixer` module"),
    Refusal("step.mamba_checkpointing", _STEP, "gradient checkpointing on Mamba2 / Mamba / FalconMamba (pure) "
            "models", "their backbone passes no kwargs to its blocks, so a recomputed block could not find zorro's "
            "plan", "call", _HF + "ssm", "whose model does not pass zorro's step context"),
    Refusal("step.mamba_ulysses", _STEP, "Mamba v1 layers (Mamba, FalconMamba, Jamba) under Ulysses SP > 1 (also "
            "refused at FSDP engine initialisation)", "their scan's B / C are shared by all channels and not "
            "exchanged across ranks", "call", _HF + "ssm",
            "layers under Ulysses sequence parallelism are not supported by zorro"),
    Refusal("step.nemotron_h_torch_path", _STEP, "Nemotron-H without mamba-ssm on rows longer than its mixer's "
            "`chunk_size`", "transformers' torch path of its mixer depends on where the chunk boundaries fall (not "
            "the Mamba-2 recurrence); no deduplicated forward can equal it", "call", _HF + "ssm",
            "crosses one, so no deduplicated forward can equal"),
    Refusal("step.mamba_fused_group_norm", _STEP, "Mamba2 / Bamba / Granite 4 hybrid with `n_groups > 1` on CUDA "
            "with mamba-ssm installed", "the stock fused path normalises the scan output per group, its torch path "
            "(whose norm zorro runs) over all channels", "call", _HF + "ssm",
            "the stock fused path normalises the scan output per group"),
    Refusal("step.vlm_family", _STEP, "vision towers outside the Qwen2-VL family", "zorro's media handling is "
            "written for its placeholders and grids", "model", _HF + "vision", "zorro supports the Qwen2-VL family"),
    Refusal("step.media_keys", _STEP, "multimodal inputs other than images / videos of the Qwen2-VL family",
            "not handled by zorro's media packing", "call", "zorro_verl.packing.multimodal",
            "are not supported by zorro (it handles"),
)

#: Messages the drift check finds that are not refusals of a setting: ``(module, phrase) -> why exempt``.
EXEMPT = {
    (_HF + "context", "called without zorro's step context"): "wiring: the model was called outside zorro_step",
    (_HF + "install", "attention layers but the zorro attention was called"):
        "the per-step layer-call check (a layer bypassed zorro), not a setting",
    (_V09 + "registration", "not the zorro engine (another plugin replaced it?)"): "install check of the plugin",
    (_V09 + "registration", "as the value-model (critic) engine for strategy"): "install check of the plugin",
    (_V09 + "registration", "has no language_model engine for strategy"): "install check of the plugin",
    (_V09 + "balance", "does not split into mini-batches"): "bad batch size, which verl's worker refuses too",
    (_HF + "ssm", "ulysses_sequence_parallel_size = {}: {}"): "wraps ssm._SP_REFUSAL (step.mamba_ulysses)",
    (_V09 + "engine", "logits_optimization=memory: {}"): "wraps step.head_fn_unsupported (step.softcap_head_fn)",
    ("zorro_verl.packing.routes", "router replay: the recorded routes"):
        "a data check of router replay, which the step and the engine refuse before (mcore.routing_replay)",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """The text of ``docs/refusals.md``: one table, grouped by :data:`WHERE`."""
    out = ["# What zorro refuses, and why", "",
           "Generated from `zorro_verl/refusals.py` (`python -m zorro_verl.refusals > docs/refusals.md`); "
           "`tests/test_refusals.py` checks that this page, that list and the messages in the code agree. "
           "Each row is a setting zorro cannot run exactly: zorro never falls back silently. *When*: `start` = at "
           "engine / actor start, `model` = once the model is built (install or engine initialisation), `batch` = "
           "per batch, `call` = at each call of the function named. The design reasons are in "
           "[design/verl.md](design/verl.md), [design/megatron.md](design/megatron.md), "
           "[design/openrlhf.md](design/openrlhf.md) and [design/model-step.md](design/model-step.md).", "",
           f"{len(REFUSALS)} refusals in all.", ""]
    for where, what in WHERE.items():
        rows = [r for r in REFUSALS if r.where == where]
        out += [f"## {where}", "", f"{len(rows)} refusals. {what}", "", "| setting | why | when | raised in |",
                "|---|---|---|---|"]
        for r in rows:
            path = r.module.replace(".", "/") + ".py"
            out.append(f"| {_cell(r.setting)} | {_cell(r.why)} | {r.when} | `{path}` |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["--markdown"]):
        sys.exit("usage: python -m zorro_verl.refusals [--markdown] > docs/refusals.md")
    sys.stdout.write(markdown())
