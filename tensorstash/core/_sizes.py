"""Sizes and shares: one grammar for every argument that names an amount of memory.

# NOTE [ Sizes ]
1. A size is bytes: an int (``1073741824``), or a string with a unit
   (``"1GiB"``, ``"1 GiB"``, ``"1.5GB"``, ``"512MiB"``, ``"64k"``): the ``i``
   units are powers of 1024, the others of 1000, and the unit is read without
   regard to case. A bare whole number in a string is bytes (``"4096"``); a
   bare number with a point is the float it spells (``"0.5"``: a share).
2. A share is a part of something larger: a float in (0, 1] (``0.9``) or a
   percentage (``"90%"``). What it is a share of is the argument's to say
   (``Auto``'s ``limit``: the device's capacity; the bench's ``auto:<share>``:
   no stash's real peak growth). An argument that takes no share says so.
3. The same string means the same thing in the API, the command line and the
   docs: ``tensorstash plan --budget 50%`` and ``Auto(device_budget="50%")``
   are one budget.
4. A size that looks like a mistake is refused: a memory limit or budget of
   50 bytes was meant as 50%, or 50 MiB. Arguments that hold at least
   ``least`` bytes when not zero say so, and the message names both readings.
"""

from __future__ import annotations

import re

__all__ = ["Share", "parse_size", "resolve_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")


class Share(float):
    """A share of something larger, in (0, 1] (rule 2): ``Share(0.5)`` or ``"50%"``."""

    def __repr__(self) -> str:
        return f"{100 * float(self):g}%"

    def of(self, total: int) -> int:
        """The bytes this share is of ``total``."""
        return int(float(self) * total)


def parse_size(
    value: object, api: str, name: str, *, share: bool = True, least: int = 0
) -> int | Share:
    """Read ``value`` as a size (bytes) or, where ``share`` allows, a share (NOTE [ Sizes ]).

    Args:
        value: an int, a float in (0, 1], or a string such as "2GiB" or "50%".
        api: the API that takes it, for the message ("tensorstash.Auto").
        name: the argument's name, for the message.
        share: whether a share is allowed.
        least: the fewest bytes a nonzero size may be (rule 4); 0 for none.

    Returns:
        Bytes (an int), or a :class:`Share`.

    Raises:
        TypeError: not an int, float or str, or a float where no share is allowed.
        ValueError: a string of no size, a negative size, a share outside (0, 1], a
            share where none is allowed, or a size under ``least``.
    """
    if type(value) is int and (value == 0 or value >= least):  # every session's min_bytes
        return value
    spelled = _spellings(share)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{api}: {name} must be {spelled}; got {value!r}")
    if isinstance(value, float):
        if not share:  # bytes are whole: 1.5 is neither bytes nor, here, a share
            raise TypeError(f"{api}: {name} must be {spelled}; got {value!r}")
        return _share(value, value, api, name, share, spelled)
    if isinstance(value, str):
        percent = _PERCENT.match(value)
        if percent is not None:
            return _share(float(percent.group(1)) / 100, value, api, name, share, spelled)
        match = _SIZE.match(value)
        if match is None:
            raise ValueError(f"{api}: {name} must be {spelled}; got {value!r}")
        number, prefix, binary, unit = match.groups()
        if binary and not prefix:
            raise ValueError(f"{api}: {name} must be {spelled}; got {value!r}")
        if not (prefix or unit) and "." in number:  # "0.5" is the float it spells: a share
            return _share(float(number), value, api, name, share, spelled)
        if prefix:
            power = "kmgtp".index(prefix.lower()) + 1
            number_bytes = float(number) * (1024 if binary else 1000) ** power
        else:
            number_bytes = float(number)
        value = int(number_bytes)
    if value < 0:
        raise ValueError(f"{api}: {name} must be at least 0 bytes; got {value}")
    if 0 < value < least:
        other = f" or a share such as '{value}%'" if share and value <= 100 else ""
        raise ValueError(
            f"{api}: {name} of {value} bytes is under the {least} bytes it can mean; pass "
            f"a size such as '{value}MiB'{other}"
        )
    return value


def resolve_size(size: int | Share | float, total: int) -> int:
    """Bytes of what :func:`parse_size` gave: a share is of ``total``."""
    return int(float(size) * total) if isinstance(size, float) else int(size)


def _share(
    fraction: float, given: object, api: str, name: str, allowed: bool, spelled: str
) -> Share:
    if not allowed:
        raise ValueError(f"{api}: {name} takes no share; it must be {spelled}; got {given!r}")
    if not 0 < fraction <= 1:
        raise ValueError(
            f"{api}: {name} as a share must be in (0, 1], such as 0.5 or '50%'; got {given!r}"
            + ("" if isinstance(given, str) else "; for bytes pass an int or a size such as '2GiB'")
        )
    return Share(fraction)


def _spellings(share: bool) -> str:
    sizes = "bytes (an int) or a size such as '512MiB' or '2GB'"
    return f"{sizes}, or a share such as 0.5 or '50%'" if share else sizes


def size_fields(owner: object, api: str, *names: str, optional: tuple[str, ...] = ()) -> None:
    """Read each field ``names`` of the frozen dataclass ``owner`` as a size (no share),
    in place: ``DiskSpill(max_disk_bytes="1GiB")`` holds 1073741824 (rule 3). Fields in
    ``optional`` may be None."""
    for name in names:
        value = getattr(owner, name)
        if value is None and name in optional:
            continue
        try:
            size = parse_size(value, api, name, share=False)
        except TypeError:
            none = "None, " if name in optional else ""
            raise TypeError(
                f"{api}: {name} must be {none}bytes (an int) or a size such as '512MiB'; "
                f"got {value!r}"
            ) from None
        object.__setattr__(owner, name, int(size))
