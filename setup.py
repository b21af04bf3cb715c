"""The optional C and C++ extensions; everything else is in pyproject.toml.

Without a compiler the build goes on without them: tensorstash then uses its
pure-Python hooks (NOTE [ Fast path ] in tensorstash/core/_fastpath.py) and hands
memory back by trimming the heap (NOTE [ Session pool ] in tensorstash/memory/_pool.py);
``tensorstash.info()`` says which extensions are active, and why not.

The session pool (``tensorstash.memory._alloc``) builds against the torch of the
environment it is installed into, and is stamped with that torch's version,
which it checks at import (rule 5). Under ``pip install --no-build-isolation``
that torch is importable here. Under an isolated build (a plain ``pip install .``)
it is not, so the build asks the interpreter that runs pip, started with ``-I``
(its own site-packages, not the isolated environment's), where its torch is.
Where no torch is found (torch is not installed yet), the pool is not built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from setuptools import Extension, setup

_PROBE = (
    "import json, os, torch; print(json.dumps({'root': os.path.dirname(torch.__file__), "
    "'version': torch.__version__, 'abi': int(torch._C._GLIBCXX_USE_CXX11_ABI)}))"
)


def _find_torch() -> dict[str, object] | None:
    """Where the torch that tensorstash will run with lives: this interpreter's, or, in
    an isolated build, that of the interpreter running pip (its site-packages)."""
    try:
        import torch
    except ImportError:
        pass
    else:
        return {
            "root": os.path.dirname(torch.__file__),
            "version": torch.__version__,
            "abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
        }
    try:
        found = subprocess.run(
            [sys.executable, "-I", "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        return dict(json.loads(found.stdout.strip().splitlines()[-1]))
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def _session_pool() -> list[Extension]:
    if not sys.platform.startswith("linux"):
        return []  # mmap, mremap: Linux only (rule 5)
    torch = _find_torch()
    if torch is None:
        print(
            "tensorstash: no torch found to build the session pool against; tensorstash will "
            "trim the heap instead (install torch first, then tensorstash)",
            file=sys.stderr,
        )
        return []
    root = str(torch["root"])
    return [
        Extension(
            "tensorstash.memory._alloc",
            sources=["tensorstash/memory/_alloc.cpp"],
            language="c++",
            include_dirs=[os.path.join(root, "include")],
            library_dirs=[os.path.join(root, "lib")],
            libraries=["c10"],
            optional=True,
            extra_compile_args=[
                "-O2",
                "-std=c++17",
                f"-D_GLIBCXX_USE_CXX11_ABI={torch['abi']}",
                f"-DTENSORSTASH_TORCH_VERSION={json.dumps(str(torch['version']))}",
            ],
        )
    ]


def _sampler() -> list[Extension]:
    if not sys.platform.startswith("linux"):
        return []  # /proc/self/statm: Linux only (NOTE [ Real memory ] in _memory.py)
    return [
        Extension(
            "tensorstash.memory._sampler",
            sources=["tensorstash/memory/_sampler.c"],
            optional=True,
            extra_compile_args=["-O2", "-std=c11"],
        )
    ]


setup(
    ext_modules=[
        Extension(
            "tensorstash.core._fast",
            sources=["tensorstash/core/_fast.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        *_session_pool(),
        *_sampler(),
    ]
)
