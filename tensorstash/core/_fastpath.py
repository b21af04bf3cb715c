"""Whether the session's kept path runs in C.

# NOTE [ Fast path ]
Most saved tensors are kept where they are: small ones (under ``min_bytes``),
and, under Auto's budget or with ``Keep``, the rest. The Python pack hook for
them is a few dozen bytecodes, several times what autograd's call of an
identity hook costs, and so are its counts and its record (figures:
docs/figures/session.md). ``_fast.c`` does the same work in C:

1. One hook pair per session. A session with no profile, no decision log and
   no ``verify`` pushes the C hooks (:class:`Hooks`); any other session pushes
   its Python hooks, which stay the reference.
2. The C pack follows the pack rules (NOTE [ Pack rules ] in
   session/rules.py) in their order, reading the same attributes, and hands
   the tensor to the Python hook at the first case it does not take on
   itself: a subclass, a leaf or a parameter's view or copy, an address that
   module state or a live pack holds, modules entered since state was last
   read. A choice other than ``Keep`` goes to the session's packing of a
   chosen policy, as in Python. tests/test_pack_rules.py holds the paths equal.
3. A kept tensor is a C :class:`Kept` in both paths, so either unpack reads
   the other's; when the extension is missing both paths use the Python
   ``PyKept`` (session/values.py) and ``HotCounts``, which behave the same.
4. A freed ``Kept`` adds its bytes to ``HotCounts.released`` with the GIL held,
   on whatever thread frees it; the hooks' thread takes them off ``live``.
5. A selector may let the C pack keep tensors without asking it. Its choose
   posts in ``HotCounts`` (``post(limit, on_cpu, count)``) how far ``live``
   may grow, for tensors on which side and for how many. Any
   pack the Python hooks or a policy handle ends the posting, as does the last
   of ``keep_left``: then the selector is asked again. Auto posts its rule 4
   (see ``Chooser.choose`` in planning/_auto_choice.py).
6. The extension is optional: built when a compiler is there, skipped
   otherwise. ``TENSORSTASH_PURE_PYTHON=1`` in the environment, read at import,
   turns it off; the test suite runs its core files that way too.
7. The C hooks reach Python only through what they are handed when made
   (``Session._hooks``; typed in _fast.pyi): the callables ``pack``,
   ``unpack``, ``pack_chosen``, ``prefetch`` and ``choose``, and the declared
   fields of the values they share (``Order.last``, ``Dedupe.values`` and
   ``sweep_at``, the kept tier's ``live_bytes``, the module state table).
"""

from __future__ import annotations

import os
from types import ModuleType

compiled: ModuleType | None
if os.environ.get("TENSORSTASH_PURE_PYTHON", "") not in ("", "0"):
    compiled = None
else:
    try:
        from tensorstash.core import _fast as compiled
    except ImportError:  # built without a compiler: the Python hooks (rule 6)
        compiled = None
