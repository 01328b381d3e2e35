"""Packing layer: grouping, the per-micro-batch plan, gather/scatter. Imports torch only."""

from zorro_verl.packing.plan import ATTENTION_BACKENDS, ZorroPlan, build_plan, require_plan

__all__ = ["ATTENTION_BACKENDS", "ZorroPlan", "build_plan", "require_plan"]
