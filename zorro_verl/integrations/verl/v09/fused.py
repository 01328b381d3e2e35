"""verl's fused kernels (``actor_rollout_ref.model.use_fused_kernels=true``) on zorro's packed row
(docs/design/logprob.md, model-step.md, verl.md).

What verl does. With fused kernels verl's FSDP engine replaces the model **class's** ``forward``
(``verl.models.transformers.monkey_patch.patch_forward_with_backends``; for text models
``verl.models.transformers.dense_common.forward_with_{torch,triton}_backend``) and records the kernel backend on the
instance (``model._verl_fused_kernels_backend``: ``torch``, ``liger`` or ``triton``). The patched forward runs the
decoder (``self.model``) on the whole packed stream, then computes log-probs and entropy from the hidden states and
``self.lm_head.weight`` in chunks (``FusedLinearForPPO`` / ``linear_cross_entropy``) with rolled labels and one
float temperature, never materialising ``[T, V]`` logits; log-probs are fp32, entropy is in the hidden states'
dtype.

Why zorro does not call that forward. It passes the decoder an explicit, fixed list of arguments and drops every
other keyword (``**loss_kwargs``), so zorro's ``zorro_ctx`` would never reach the attention layers; it also
ignores ``logits_to_keep`` and would compute the head at every position of the packed row with wrong rolled labels
(the packed row's next token is not each response's next token).

The chosen way. For the duration of one step the model gets an *instance* ``forward`` (:func:`_zorro_root_forward`) that
does what verl's ``forward_base_model`` does — ``self.model(...)`` — but passes zorro's keywords through, and then calls
the head module on the ``[1, N, H]`` response-predicting hidden states (``logits_to_keep`` = the plan's
``logit_index``). "The model" is the root module under FSDP2 (``fully_shard`` keeps the class and works through hooks)
and the module inside the root's wrapper under FSDP1 (``forward_owner``) — with LoRA the ``*ForCausalLM`` inside the
``PeftModel`` (:func:`fused_owner`): the ``PeftModel``'s own ``.model`` resolves to that patched model, whose forward
would drop zorro's keywords —, which is where verl's class patch takes effect too: the root is still called as a module,
so FSDP2's hooks or FSDP1's wrapper forward (lazy root initialisation, unshard, input casting, backward registration)
run as in any forward. An instance ``forward`` on the FSDP1 wrapper itself would skip them (measured: the first call
fails, a decoder-layer unit having initialised itself as the root; with 2 ranks the wrapper's parameters are still
sharded). The head module's forward is in turn swapped by ``zorro_step``'s head-function seam (``head_fn``, see
``zorro_verl.integrations.transformers.step._head_step``; under FSDP1 also inside the head's own wrapper, if a wrap
policy made it a unit) for :class:`FusedHead`, which hands the ``[N, H]`` hidden states, the head's weight, the plan's
targets and the batch's float temperature to the same verl kernel verl's forward would use, with verl's chunk size. Per
row this is the op sequence of verl's fused forward (``hidden @ W.T / temperature``, fp32 upcast, log-softmax /
entropy), only at the ``N`` rows that predict response tokens. For a prefix-tree plan (``sharing=prefix``) the head
receives the ``Nh`` distinct predicting positions and each output's row; verl's kernel takes one hidden row per target,
so :class:`FusedHead` expands them per output: on this path the head runs once per output, not once per distinct
position as in zorro's own ``memory`` mode (the decoder still runs once per trie token). The root forward's output is a
``ModelOutput`` (FSDP2 traverses it to register its backward hooks). An instance attribute shadows the class's (patched)
``forward`` without touching the class, which verl patched for the whole process.

Refused, as verl refuses them (checked by the engine before the step): per-sample temperature tensors (verl's fused
path asserts a float) and ``calculate_sum_pi_squared``. A model verl did not patch (``use_fused_kernels`` without a
``fused_kernel_options.impl_backend`` of ``torch``/``liger``/``triton``) raises: verl's own path would fail on it.
"""

from __future__ import annotations

from typing import Optional

import torch

from zorro_verl.integrations.transformers import zorro_step
from zorro_verl.integrations.transformers.step import forward_owner
from zorro_verl.packing import ZorroPlan

__all__ = ["FusedHead", "fused_backend", "fused_owner", "zorro_fused_step"]

#: The kernel backends verl's ``patch_forward_with_backends`` installs.
VERL_FUSED_BACKENDS = ("torch", "liger", "triton")


def fused_backend(module) -> str:
    """The fused-kernel backend verl recorded on ``module`` when it patched its forward; raises if it did not."""
    backend = getattr(module, "_verl_fused_kernels_backend", None)
    if backend not in VERL_FUSED_BACKENDS:
        raise ValueError(
            "use_fused_kernels: the batch asks for fused kernels but verl did not patch the model for them "
            f"(expected model._verl_fused_kernels_backend in {VERL_FUSED_BACKENDS}, got {backend!r}). Set "
            "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch (or triton), or "
            "use_fused_kernels=false.")
    return backend


class FusedHead:
    """A ``zorro_step`` head function running verl's fused linear + log-prob / entropy kernel.

    ``__call__(hidden [Nh, H], head, targets [N] int64, temperature: float, calculate_entropy, index [N] int64 |
    None) -> (log_probs [N] fp32, entropy [N] | None)``, entropy in the dtype verl's kernel returns (the hidden
    states' dtype for the torch backend), recorded in :attr:`entropy_dtype` (``zorro_step`` stacks both outputs,
    which promotes the entropy). Uses ``head.weight`` directly: it runs as the head module's forward, where FSDP has
    gathered the weight. verl's kernels take one hidden row per target, so a prefix tree's shared positions
    (``index``) are expanded per output here (``hidden[index]``): the head runs once per output on this path (zorro's
    own ``memory`` mode runs it once per distinct position).
    """

    def __init__(self, backend: str):
        self.backend = backend
        self.entropy_dtype: Optional[torch.dtype] = None

    def __call__(self, hidden, head, targets, temperature, calculate_entropy, index=None):
        if index is not None:  # verl's kernel: one hidden row per target (autograd sums the copies' gradients)
            hidden = hidden[index]
        if self.backend == "triton":
            from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

            logp, ent = linear_cross_entropy(hidden, head.weight, targets, float(temperature), "none")
        else:
            from verl.utils.experimental.torch_functional import FusedLinearForPPO

            # verl's forward builds the module with its default chunk size (512 rows)
            logp, ent = FusedLinearForPPO(impl_backend=self.backend).forward(
                hidden_states=hidden, vocab_weights=head.weight, input_ids=targets, temperature=temperature)
        self.entropy_dtype = ent.dtype
        return logp, (ent if calculate_entropy else None)


def _zorro_root_forward(self, input_ids=None, position_ids=None, attention_mask=None, use_cache=None,
                        logits_to_keep=0, labels=None, return_dict=None, **kwargs):
    """verl's ``forward_base_model`` (the decoder, ``self.model``) with zorro's keywords passed through, then the head
    on the kept positions: ``input_ids [1, T]`` -> ``logits`` = the head's output on ``hidden[:, logits_to_keep]``.
    ``labels`` / ``return_dict`` are the ``*ForCausalLM``'s own keywords (PEFT's forward passes them, as None), not
    the decoder's."""
    from verl.models.transformers.dense_common import CausalLMOutputForPPO

    if labels is not None:
        raise ValueError("labels: zorro's fused step computes no HF loss from labels; got a tensor (call the model "
                         "without labels).")

    hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=use_cache, **kwargs)[0]  # [1, T, H]
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return CausalLMOutputForPPO(logits=self.get_output_embeddings()(hidden[:, keep]))


def fused_owner(module):
    """The module whose ``forward`` zorro's step replaces: the ``*ForCausalLM`` verl patched for fused kernels (it
    carries ``_verl_fused_kernels_backend``): the module inside FSDP1's wrapper or the FSDP2 root
    (:func:`~zorro_verl.integrations.transformers.step.forward_owner`), and under PEFT the model the ``PeftModel``
    wraps (``PeftModel.base_model.model``): its forward, not the ``PeftModel``'s, is verl's patched one, and PEFT's
    forwards call it with every keyword, zorro's included."""
    owner = forward_owner(module)
    m = owner
    for _ in range(4):  # PeftModel -> LoraModel (.base_model) -> *ForCausalLM (.model)
        if "_verl_fused_kernels_backend" in vars(m):
            return m
        inner = m._modules.get("base_model") or (m._modules.get("model") if hasattr(m, "peft_config") else None)
        if inner is None:
            break
        m = inner
    return owner


def zorro_fused_step(module, plan: ZorroPlan, *, backend: str, temperature: float, calculate_entropy: bool,
                     shard=None):
    """``zorro_step`` of ``plan`` on a model verl patched for fused kernels (see the module docstring).

    Args:
        module: the root ``*ForCausalLM`` (FSDP-wrapped) with zorro installed and verl's fused forward patched in.
        plan: the micro-batch's plan.
        backend: the attention backend name.
        temperature: the batch's one float temperature (verl's fused kernels take no per-sample tensor).
        calculate_entropy: also return the entropy.
        shard: this rank's ``UlyssesShard`` under sequence parallelism (see ``zorro_step``), or None.

    Returns:
        ``(log_probs [N] fp32, entropy [N] | None)`` in original row order, entropy in verl's fused dtype.
    """
    if isinstance(temperature, torch.Tensor):
        raise ValueError("temperature: verl's fused kernels take one float temperature, got a tensor of shape "
                         f"{tuple(temperature.shape)}; use one temperature per batch or use_fused_kernels=false.")
    head = FusedHead(fused_backend(module))
    owner = fused_owner(module)
    had_own = "forward" in owner.__dict__
    saved = owner.__dict__.get("forward")
    owner.forward = _zorro_root_forward.__get__(owner)
    try:
        # called through the root as a module: FSDP1's wrapper forward (unshard, input casting) then the model's
        logp, ent = zorro_step(module, plan, backend=backend, temperature=float(temperature),
                               calculate_entropy=calculate_entropy, head_fn=head, shard=shard)
    finally:
        if had_own:
            owner.forward = saved
        else:
            del owner.forward
    if ent is not None:
        ent = ent.to(head.entropy_dtype)
    return logp, ent
