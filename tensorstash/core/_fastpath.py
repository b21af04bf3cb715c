"""Whether the session's kept path runs in C.

# NOTE [ Fast path ]
Most saved tensors are kept where they are: small ones (under ``min_bytes``),
and, under Auto's budget or with ``Keep``, the rest. The Python pack hook for
them is a few dozen bytecodes, 3 to 5 times what autograd's call of an
identity hook costs, and so are its counts and its record. ``_fast.c`` does
the same work in C:

1. One hook pair per session. A session with no profile, no decision log and
   no ``verify`` pushes the C hooks (:class:`Hooks`); any other session pushes
   its Python hooks, which stay the reference.
2. The C pack does what ``Session.pack`` does for a plain Tensor up to rule 4
   of NOTE [ Session ], reading the same attributes in the same order, and
   hands the tensor to the Python hook at the first case it does not take on
   itself: a subclass, a leaf or a parameter's view or copy, an address that
   module state or a live pack holds, modules entered since state was last
   read. A choice other than ``Keep`` goes to ``Session._pack``, as in Python.
3. A kept tensor is a C :class:`Kept` in both paths, so either unpack reads
   the other's; when the extension is missing both paths use the Python
   ``_Kept`` and ``HotCounts``, which behave the same.
4. A freed ``Kept`` adds its bytes to ``HotCounts.released`` with the GIL held,
   on whatever thread frees it; the hooks' thread takes them off ``live``.
5. A selector may let the C pack keep tensors without asking it. Its choose
   posts in ``HotCounts`` how far ``live`` may grow (``keep_limit``), for
   tensors on which side (``keep_cpu``) and for how many (``keep_left``). Any
   pack the Python hooks or a policy handle ends the posting, as does the last
   of ``keep_left``: then the selector is asked again. Auto posts its rule 4
   (see ``_AutoState.choose``).
6. The extension is optional: built when a compiler is there, skipped
   otherwise. ``TENSORSTASH_PURE_PYTHON=1`` in the environment, read at import,
   turns it off; the test suite runs its core files that way too.
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
