"""Policies by name: "keep", "cpu", "lz4", "disk" (tiers/_names.py) and "auto"
(planning/auto.py) enter themselves here when imported.

``stash()`` resolves the name it is given here without importing any policy, so
the session knows policies only through their protocol and imports run one way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tensorstash.core.policy import Policy

NAMES: dict[str, Callable[[], Any]] = {}
"""Every policy name, and what makes its policy."""


def register(name: str, make: Callable[[], Any]) -> None:
    """Let ``stash(name)`` (and selectors' rules) stand for ``make()``."""
    NAMES[name] = make


def resolve(
    policy: Policy | str, names: Mapping[str, Callable[[], Any]] = NAMES, api: str = "stash"
) -> Policy:
    """A policy object from a policy or its name.

    Args:
        policy: a policy object, or a key of ``names``.
        names: the names accepted.
        api: the API named in errors ("stash", "Select").

    Raises:
        ValueError: an unknown name.
        TypeError: neither a name nor an object with ``pack`` and ``unpack``.
    """
    if isinstance(policy, str):
        factory = names.get(policy)
        if factory is None:
            raise ValueError(
                f"tensorstash.{api}: unknown policy name {policy!r}; use one of "
                f"{', '.join(repr(n) for n in names)} or a policy object such as "
                "tensorstash.Chain(tensorstash.Lz4(), tensorstash.DiskSpill())"
            )
        made: Policy = factory()
        return made
    if isinstance(policy, type):
        raise TypeError(
            f"tensorstash.{api}: policy is the class {policy.__name__}, not a policy; "
            f"pass an instance: {policy.__name__}()"
        )
    if not (callable(getattr(policy, "pack", None)) and callable(getattr(policy, "unpack", None))):
        raise TypeError(
            f"tensorstash.{api}: policy must be a policy object (with pack and unpack) or a "
            f"name such as 'lz4'; got {type(policy).__name__} {policy!r}"
        )
    return policy
