"""The torch versions tensorstash supports, and what steps aside on an older one (NOTE
[ Support range ] in tensorstash/core/_support.py)."""

from __future__ import annotations

import pytest
import torch

from tensorstash.core import _support


def test_a_torch_without_the_hook_stack_is_refused_at_import_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule 1: torch before 2.8 has no ``_top_saved_tensors_default_hooks``, which every
    session reads; the error names the torch found and what to install."""
    _support.check_floor()  # this torch
    monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks")
    with pytest.raises(ImportError, match=r"needs torch 2\.8 or newer .* torch \S+ is installed"):
        _support.check_floor()
    with pytest.raises(ImportError, match=r"pip install 'torch>=2\.8'"):
        _support.check_floor()


@pytest.mark.parametrize("feature", [_support.COMPILED, _support.OFFLOAD])
def test_a_feature_this_torch_lacks_says_what_it_needs_in_one_sentence(feature: str) -> None:
    """Rule 2: the message names the feature, the torch that has it and the torch here;
    found by what the torch has, not by its version number (rule 4)."""
    import torch._functorch.config as functorch_config

    if feature == _support.COMPILED:
        from torch._functorch._aot_autograd import graph_compile

        has = hasattr(graph_compile, "_get_saved_tensor_hook_context") and hasattr(
            functorch_config, "joint_custom_pass"
        )
    else:
        has = hasattr(functorch_config, "enable_activation_offloading")
    said = _support.missing(feature)
    if has:
        assert said is None
    else:
        assert said is not None and said.startswith(f"{feature} needs torch 2.10 or newer")
        assert torch.__version__ in said


def test_an_unknown_feature_is_a_bug() -> None:
    with pytest.raises(ValueError, match="bug in tensorstash"):
        _support.missing("flying")
