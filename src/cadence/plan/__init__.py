"""``cadence plan``: candidates under a memory budget, estimated, measured in short trials, checked for quality."""

from cadence.plan.planner import PlanFailed, PlanOptions, make_plan
from cadence.plan.report import plan_report

__all__ = ["PlanFailed", "PlanOptions", "make_plan", "plan_report"]
