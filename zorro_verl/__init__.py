"""zorro_verl: exact prompt-deduplicated forward/backward for GRPO/PPO training (split attention).

The reference API's names: ``ZoRRoTrain``, ``ReconstructionInfo``, ``packed_ppo_policy_loss``,
``DeduplicatedActor``, ``Qwen3ModelOncePatcher``, ``ModelOutput`` (``create_dummy_batch`` lives in
``zorro_verl.testing``). ``import zorro_verl`` imports torch only; transformers is imported when a model is loaded
or zorro is installed on one. Layout and design: docs/DESIGN.md.
"""

from zorro_verl.api import (
    DeduplicatedActor,
    ModelOutput,
    Qwen3ModelOncePatcher,
    ReconstructionInfo,
    ZoRRoTrain,
    packed_ppo_policy_loss,
)
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
