"""Packing layer: grouping, the per-micro-batch plan, index helpers, micro-batching. Imports torch only."""

from zorro_verl.packing.grouping import group_ids
from zorro_verl.packing.plan import PlanMemo, ZorroPlan, build_plan
from zorro_verl.packing.tree import DEFAULT_MIN_SHARED_LEN, SHARING_MODES, PrefixTree

__all__ = ["PlanMemo", "ZorroPlan", "build_plan", "group_ids", "PrefixTree", "SHARING_MODES", "DEFAULT_MIN_SHARED_LEN"]
