"""``cadence profile``: where a step's time goes (phases, operators, MFU), its report, and comparing two profiles."""

from cadence.profiling.compare import compare_profiles, write_comparison
from cadence.profiling.profiler import ProfileOptions, ProfileSettings, StepProfiler, run_profile
from cadence.profiling.report import profile_report

__all__ = ["ProfileOptions", "ProfileSettings", "StepProfiler", "compare_profiles", "profile_report", "run_profile",
           "write_comparison"]
