"""Packing layer: grouping, the per-micro-batch plan, index helpers, micro-batching. Imports torch only."""

from zorro_verl.packing.grouping import group_ids
from zorro_verl.packing.plan import PlanMemo, ZorroPlan, build_plan

__all__ = ["PlanMemo", "ZorroPlan", "build_plan", "group_ids"]
