"""The optional C and C++ extensions; everything else is in pyproject.toml.

Without a compiler the build goes on without them: tensorstash then uses its
pure-Python hooks (NOTE [ Fast path ] in tensorstash/_fastpath.py) and hands
memory back by trimming the heap (NOTE [ Session pool ] in tensorstash/_pool.py).
The session pool (``tensorstash._alloc``) builds against the torch installed
where the build runs, so it is built only where torch can be imported there:
``pip install --no-build-isolation`` (as ``make install`` does).
"""

import os

from setuptools import Extension, setup


def _session_pool() -> list[Extension]:
    try:
        import torch
    except ImportError:
        return []
    root = os.path.dirname(torch.__file__)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        Extension(
            "tensorstash._alloc",
            sources=["tensorstash/_alloc.cpp"],
            language="c++",
            include_dirs=[os.path.join(root, "include")],
            library_dirs=[os.path.join(root, "lib")],
            libraries=["c10"],
            optional=True,
            extra_compile_args=["-O2", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"],
        )
    ]


setup(
    ext_modules=[
        Extension(
            "tensorstash._fast",
            sources=["tensorstash/_fast.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        *_session_pool(),
    ]
)
