"""Policies by name: "keep", "cpu", "lz4", "disk" (and "auto", given by the caller).

Selectors resolve the names their rules return here, and ``stash()`` the name
it is given; this module imports only the policies, so imports run one way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tensorstash.core.policy import Keep, Policy
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


def resolve(
    policy: Policy | str, names: Mapping[str, Callable[[], Any]] = POLICIES, api: str = "stash"
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
