"""Deciding where tensors go: Auto (auto), the records carried across steps (profile),
the plan and its solver (plan), the speeds it weighs (_rates), and compiled code
planned through the compiler (compiler)."""
