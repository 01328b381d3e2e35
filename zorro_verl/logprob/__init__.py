"""Response-only log-probs and entropy (docs/design/logprob.md): the names of :mod:`.response`. Imports torch only."""

from zorro_verl.logprob.response import (
    DEFAULT_CHUNK,
    LEAN_BLOCKS,
    LOGITS_MODES,
    TEMPERATURE_OPS,
    check_logits_optimization,
    check_temperature_op,
    linear_head_params,
    linear_logprobs,
    logits_logprobs,
    logprobs_from_logits,
    response_logprobs,
    scaled_logits,
    unscaled_grad,
)

__all__ = ["LOGITS_MODES", "DEFAULT_CHUNK", "LEAN_BLOCKS", "TEMPERATURE_OPS", "check_logits_optimization",
           "check_temperature_op", "response_logprobs", "logits_logprobs", "logprobs_from_logits", "linear_logprobs",
           "linear_head_params", "scaled_logits", "unscaled_grad"]
