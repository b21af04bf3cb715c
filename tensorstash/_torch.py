"""torch, imported without the warning it gives where numpy is not installed.

tensorstash needs no numpy, and its base install brings none. torch 2.13 warns
"Failed to initialize NumPy: No module named 'numpy'" while it imports (its
``FunctionalTensor`` class body builds a ``torch.device``, whose argument parser
looks for numpy scalars), once per process. Where tensorstash is what imports
torch first, that one warning is left out; a numpy that is installed but fails
to load still warns, and torch's numpy functions still raise where numpy is
missing. A program that imported torch itself got the warning from torch.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings(
        "ignore",
        message="Failed to initialize NumPy: No module named 'numpy'",
        category=UserWarning,
    )
    import torch

__all__ = ["torch"]
