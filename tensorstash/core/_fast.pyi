"""Types of the C extension (NOTE [ Fast path ] in _fastpath.py)."""

from collections.abc import Callable
from typing import Any

class HotCounts:
    small_tensors: int
    small_bytes: int
    tensors: int
    bytes: int
    live: int
    peak: int
    unpacks: int
    keep_limit: int
    keep_left: int
    keep_cpu: bool
    @property
    def released(self) -> int: ...
    def post(self, limit: int, on_cpu: bool, count: int, /) -> None: ...
    def unpost(self) -> None: ...
    def release(self, nbytes: int, /) -> None: ...
    def drain(self) -> None: ...
    def pending(self) -> int: ...

class Kept:
    def __init__(
        self, tensor: Any, version: int, nbytes: int, hot: HotCounts, prev: Any
    ) -> None: ...
    @property
    def tensor(self) -> Any: ...
    @property
    def version(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def prev(self) -> Any: ...
    @property
    def hot(self) -> HotCounts: ...
    def geometry(self) -> tuple[Any, ...]: ...
    def changed(self) -> bool: ...

class Hooks:
    def __init__(
        self,
        *,
        owner: Any,
        pack: Any,
        unpack: Any,
        hot: HotCounts,
        kept_tier: Any,
        dedupe: Any,
        values: dict[int, Any],
        state: dict[int, Any],
        thread: Any,
        policy: Any,
        choose: Any,
        ctx: Any,
        tensor_type: type,
        parameter_type: type,
        keep_type: type,
        copies: frozenset[type],
        sequence_nr: Any,
        pack_chosen: Callable[[Any, int, Any, Any, Any, Any], Any],
        prefetch: Callable[[Any], None],
        order: Any,
        min_bytes: int,
    ) -> None: ...
    @property
    def owner(self) -> Any: ...
    def pack(self, tensor: Any, /) -> Any: ...
    def unpack(self, saved: Any, /) -> Any: ...
