"""The reference API (docs/design/api.md): ``DeduplicatedActor``, ``Qwen3ModelOncePatcher``, ``ModelOutput``
(:mod:`.actor`), ``ZoRRoTrain``, ``ReconstructionInfo`` (:mod:`.train`) and ``packed_ppo_policy_loss``
(:mod:`.loss`). ``create_dummy_batch`` lives in :mod:`zorro_verl.testing`, as in the reference's test module."""

from zorro_verl.api.actor import DeduplicatedActor, ModelOutput, Qwen3ModelOncePatcher
from zorro_verl.api.loss import packed_ppo_policy_loss
from zorro_verl.api.train import ReconstructionInfo, ZoRRoTrain

__all__ = ["DeduplicatedActor", "ModelOutput", "Qwen3ModelOncePatcher", "ReconstructionInfo", "ZoRRoTrain",
           "packed_ppo_policy_loss"]
