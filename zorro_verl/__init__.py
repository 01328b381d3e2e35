"""zorro_verl: exact prompt-deduplicated forward/backward for GRPO/PPO training (split attention).

The reference API (``api-reference.txt``): ``ZoRRoTrain``, ``ReconstructionInfo``, ``packed_ppo_policy_loss``,
``DeduplicatedActor``, ``Qwen3ModelOncePatcher``, ``ModelOutput``; ``create_dummy_batch`` lives in
``zorro_verl.testing``. The actor names import transformers on first access (lazy), keeping ``import zorro_verl``
torch-only.
"""

from zorro_verl.api import ReconstructionInfo, ZoRRoTrain, packed_ppo_policy_loss
from zorro_verl.packing import ZorroPlan, build_plan

__version__ = "0.1.0"

__all__ = [
    "ZoRRoTrain",
    "ReconstructionInfo",
    "packed_ppo_policy_loss",
    "DeduplicatedActor",
    "Qwen3ModelOncePatcher",
    "ModelOutput",
    "ZorroPlan",
    "build_plan",
]

_LAZY = {"DeduplicatedActor", "Qwen3ModelOncePatcher", "ModelOutput"}


def __getattr__(name):
    if name in _LAZY:
        from zorro_verl.integrations import actor

        return getattr(actor, name)
    raise AttributeError(f"module 'zorro_verl' has no attribute {name!r}")
