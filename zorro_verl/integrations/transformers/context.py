"""What travels with one deduplicated model call besides the plan: the chosen backend and a per-forward counter.

One :class:`StepContext` is passed as the ``zorro_ctx`` kwarg of the model call; transformers forwards unknown
kwargs unchanged to every attention function and decoder-layer submodule (also under gradient checkpointing). It
is an opaque object, not a dataclass or dict: FSDP2 (and other ``tree_map``-style input casts) rebuild those, an
opaque object is passed by reference, so the counts made inside the model reach the caller.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from zorro_verl.attention import get_backend
from zorro_verl.packing import ZorroPlan
from zorro_verl.packing.multimodal import PackedMedia
from zorro_verl.packing.ulysses import UlyssesShard

__all__ = ["LayerCalls", "StepContext", "require_context", "MissingContextError", "ModelMaskError", "ACTIVE"]

#: The context of the model call in progress (set by ``install.forward_packed`` around the call): what a sequence
#: mixer uses when a module on its way dropped the ``zorro_ctx`` kwarg (a decoder layer without ``**kwargs``
#: pass-through, e.g. StableLM's). Thread- and task-local; empty outside a zorro model call.
ACTIVE: ContextVar = ContextVar("zorro_step_context", default=None)


@dataclass
class LayerCalls:
    """Counts of one forward: zorro attention calls, gated delta-net calls, layer calls that ran a slower fallback
    kernel because a fast GPU library is missing (``fallbacks[library]``), and the features each attention call
    received."""

    attention: int = 0
    recurrent: int = 0
    fallbacks: dict = field(default_factory=dict)
    #: Per attention call, in call order: ``(layer_idx | None, window | None, sinks?, softcap | None, scaling,
    #: chunk | None)`` — what the install probe reports and checks against the model's layer types.
    features: list = field(default_factory=list)
    #: ``id()`` of every module that called the zorro attention in this forward (to name the ones that did not).
    callers: set = field(default_factory=set)

    def reset(self) -> None:
        self.attention = 0
        self.recurrent = 0
        self.fallbacks.clear()
        self.features.clear()
        self.callers.clear()

    def record_features(self, layer_idx, features, scaling: float, module=None) -> None:
        self.features.append((layer_idx, features.window, features.sinks is not None, features.softcap, scaling,
                              features.chunk))
        if module is not None:
            self.callers.add(id(module))


class StepContext:
    """``plan`` (:class:`~zorro_verl.packing.ZorroPlan`), ``backend`` (a registered attention backend name),
    ``calls`` (:class:`LayerCalls`) of one deduplicated model call, ``shard``
    (:class:`~zorro_verl.packing.ulysses.UlyssesShard`) when the call runs one slice of the row under Ulysses
    sequence parallelism (None otherwise), and ``media`` (:class:`~zorro_verl.packing.multimodal.PackedMedia`:
    the packed row's images / videos and 3-D positions) for a vision-language model's multimodal batch."""

    __slots__ = ("plan", "backend", "calls", "shard", "media")

    def __init__(self, plan: ZorroPlan, backend: str = "sdpa", calls: LayerCalls | None = None,
                 shard: UlyssesShard | None = None, media: PackedMedia | None = None):
        if not isinstance(plan, ZorroPlan):
            raise TypeError(f"plan: expected a ZorroPlan (zorro_verl.packing.build_plan), got {type(plan).__name__}.")
        if shard is not None and not isinstance(shard, UlyssesShard):
            raise TypeError(f"shard: expected an UlyssesShard (zorro_verl.packing.ulysses.ulysses_shard) or None, got "
                            f"{type(shard).__name__}.")
        if media is not None and not isinstance(media, PackedMedia):
            raise TypeError(f"media: expected a PackedMedia (zorro_verl.packing.multimodal.build_media_plan) or None, "
                            f"got {type(media).__name__}.")
        get_backend(backend)  # ValueError naming the registered backends
        self.plan, self.backend, self.calls = plan, backend, calls if calls is not None else LayerCalls()
        self.shard, self.media = shard, media

    def model_inputs(self) -> tuple:
        """``(input_ids [1, L], position_ids [1, L])`` the model runs on: the packed row (``L = T``), or this rank's
        slice of it under sequence parallelism. With ``media``, ``position_ids`` is the ``[3, 1, T]`` 3-D positions;
        under sequence parallelism with ``media`` every rank gets the whole right-padded row, ``[1, T_pad]`` and
        ``[3, 1, T_pad]`` (pad: id 0, position 0): the model encodes the media and merges their features into the
        whole row's embeddings, and :func:`~zorro_verl.integrations.transformers.vision.sliced_language_model` hands
        the language model this rank's slice of them."""
        if self.media is not None:
            if self.shard is None:
                return self.plan.input_ids[None], self.media.position_ids
            pad = self.shard.padded_len - self.plan.T
            return (torch.nn.functional.pad(self.plan.input_ids, (0, pad))[None],
                    torch.nn.functional.pad(self.media.position_ids, (0, pad)))
        src = self.plan if self.shard is None else self.shard
        return src.input_ids[None], src.position_ids[None]

    def media_inputs(self) -> dict:
        """The model call's multimodal keyword arguments (``pixel_values``, ``image_grid_thw``, ...; empty without
        media)."""
        return {} if self.media is None else self.media.model_kwargs()


class MissingContextError(ValueError):
    """A sequence mixer ran outside a zorro model call: neither the ``zorro_ctx`` kwarg nor :data:`ACTIVE`."""


class ModelMaskError(ValueError):
    """The zorro attention received an attention mask although zorro registers no mask function: the model built
    one itself. The install probe turns it into a refusal naming the module."""


def require_context(ctx, who: str) -> StepContext:
    """The ``zorro_ctx`` kwarg a sequence mixer received (or, when a module on the way dropped it, the context of the
    zorro model call in progress, :data:`ACTIVE`): a :class:`StepContext`, or a clear error naming ``who``."""
    if ctx is None:
        ctx = ACTIVE.get()
    if ctx is None:
        raise MissingContextError(f"{who}: called without zorro's step context (the `zorro_ctx` kwarg is missing). "
                                  "Run the model through zorro_verl.integrations.transformers.zorro_step, or "
                                  "uninstall zorro (uninstall_zorro(model)) for an ordinary forward.")
    if not isinstance(ctx, StepContext):
        raise TypeError(f"zorro_ctx: expected a StepContext, got {type(ctx).__name__}.")
    return ctx
