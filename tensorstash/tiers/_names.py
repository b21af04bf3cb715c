"""Policies by name: "keep", "cpu", "lz4", "disk", entered in the names ``stash()``
resolves (core/_names.py); selectors resolve the names their rules return here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tensorstash.core._names import register, resolve
from tensorstash.core.policy import Keep
from tensorstash.tiers.compress import Lz4
from tensorstash.tiers.cpu import CpuOffload
from tensorstash.tiers.disk import DiskSpill

POLICIES: Mapping[str, Callable[[], Any]] = {
    "keep": Keep,
    "cpu": CpuOffload,
    "lz4": Lz4,
    "disk": DiskSpill,
}
"""The policies a name stands for."""

for _name, _make in POLICIES.items():
    register(_name, _make)

__all__ = ["POLICIES", "resolve"]
