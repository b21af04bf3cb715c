"""Deciding where tensors go: Auto (auto, and its parts _select, _auto_choice,
_auto_step, _auto_plan, _opening), the records carried across steps (profile, and
_records, _schedule, _measure, _persist), the plan (plan, its _solver and
_calibration), the speeds it weighs (_rates), and compiled code planned through the
compiler (compiler)."""
