"""Building small C++ extensions against the running torch, for the pool's tests.

The session pool is PyTorch's CPU allocator (tensorstash/memory/_alloc.cpp); some tests
need C++ beside it: another library's allocator, or the pool's own source built into a
harness that replays a race step by step. Each is built once per source, flags, torch and
Python, into a folder under the temporary directory, and imported in a subprocess with
that folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch


def compiler() -> str | None:
    """The C++ compiler (``$CXX``, else ``g++``), or None where there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def build(name: str, source: str, flags: Sequence[str] = (), *, key: str = "") -> Path:
    """The folder holding the extension module ``name`` built from the C++ ``source``
    text with ``flags``, against the running torch's headers and libc10.

    Args:
        name: the module's name (its ``PyInit_<name>``).
        source: the C++ source text.
        flags: more compiler flags (``-D...``).
        key: anything else the build depends on (an included file's text).

    Raises:
        subprocess.CalledProcessError: where it does not compile; its stderr says why.
    """
    found = compiler()
    assert found is not None, "no C++ compiler; check compiler() first"
    whole = "\n".join([source, *flags, key, torch.__version__, sys.version, found])
    folder = (
        Path(tempfile.gettempdir())
        / "tensorstash-tests"
        / hashlib.sha256(whole.encode()).hexdigest()[:16]
    )
    built = folder / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if built.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    code = folder / f"{name}.cpp"
    code.write_text(source)
    root = Path(torch.__file__).parent
    partial = folder / f"{name}.{os.getpid()}.so"
    subprocess.run(
        [
            found,
            "-O1",
            "-std=c++17",
            "-shared",
            "-fPIC",
            "-pthread",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *flags,
            f"-I{sysconfig.get_paths()['include']}",
            f"-I{root / 'include'}",
            str(code),
            f"-L{root / 'lib'}",
            "-lc10",
            "-o",
            str(partial),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    partial.replace(built)
    return folder
