"""The optional C extension; everything else is in pyproject.toml.

Without a compiler the build goes on without it, and tensorstash uses its
pure-Python hooks (NOTE [ Fast path ] in tensorstash/_fastpath.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tensorstash._fast",
            sources=["tensorstash/_fast.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
