"""verify=True: a checksum at pack, checked at unpack (NOTE [ Verify ] in _verify.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import (
    ALL_DTYPES,
    assert_grads_equal,
    grads_of,
    leak_check,
    model_policy_params,
    spill_descriptors,
)
from torch import nn
from zoo import ZOO

import tensorstash as ts
from tensorstash.core.policy import Context, Held
from tensorstash.session._verify import _sums, checksum

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(("name", "spec"), model_policy_params(list(ZOO)))
def test_verify_passes_every_lossless_policy_on_the_zoo(
    name: str, policy: Any, spill_dirs: list[Path]
) -> None:
    case = ZOO[name]()
    expected = grads_of(case.model, case.inputs, case.loss)
    session = ts.stash(policy, min_bytes=0, verify=True)
    case = ZOO[name]()
    assert_grads_equal(expected, grads_of(case.model, case.inputs, case.loss, session))
    leak_check(session, directories=spill_dirs)


@dataclass(frozen=True)
class FlipsABit:
    """A broken policy: the tensor it gives back differs from the one saved in one bit."""

    def pack(self, value: torch.Tensor, ctx: Context) -> Held:
        nbytes = value.numel() * value.element_size()
        return Held("host", nbytes, nbytes, value.detach().clone())

    def unpack(self, packed: Held, ctx: Context) -> torch.Tensor:
        broken = packed.value().clone()
        broken.view(-1)[7] = torch.nextafter(broken.view(-1)[7], torch.tensor(1e9))
        return broken


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 8))


def test_verify_stops_a_corrupted_tensor_before_backward_uses_it() -> None:
    net, x = _net(), torch.randn(32, 64)
    plain = grads_of(net, (x,), torch.sum)
    # Without verify, the broken policy silently changes the gradient:
    quiet = grads_of(net, (x,), torch.sum, ts.stash(FlipsABit(), min_bytes=0))
    assert not all(torch.equal(plain[k], quiet[k]) for k in plain)
    with pytest.raises(ts.VerifyError) as caught:
        grads_of(net, (x,), torch.sum, ts.stash(FlipsABit(), min_bytes=0, verify=True))
    message = str(caught.value)
    assert "saved by module '1'" in message or "saved by module '2'" in message  # Tanh or Linear
    assert "[32, 128]" in message and "FlipsABit" in message
    assert "no gradient is wrong" in message


def test_verify_catches_a_change_autograd_cannot_see() -> None:
    """A saved tensor changed in place without a version bump (as BatchNorm does to its
    running statistics) is invisible to the version check; the checksum sees it."""
    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash("keep", min_bytes=0, verify=True):
        h = x * 2
        y = h.sin()  # saves h
    with torch.autograd._unsafe_preserve_version_counter(h):
        h.data.add_(1)
    with pytest.raises(ts.VerifyError, match=r"\[256, 256\]"):
        y.sum().backward()


def test_spill_error_names_the_module_and_shape(tmp_path: Path) -> None:
    net, x = _net(), torch.randn(32, 64)
    with ts.stash(ts.DiskSpill(tmp_path), min_bytes=0) as session:
        loss = net(x).sum()
    loss.backward(retain_graph=True)  # files written and read once
    for file in spill_descriptors([tmp_path]):  # spill files have no name
        Path(file).write_bytes(b"")
    with pytest.raises(ts.SpillError, match=r"shape \[32, 128\].*It was saved by module '[12]'"):
        loss.backward()
    del loss, session


# -- the checksum itself -----------------------------------------------------------------


def _samples(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(3)
    if dtype == torch.bool:
        return torch.rand(6, 7, 8) > 0.5
    if dtype.is_complex:
        return torch.randn(6, 7, 8, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(6, 7, 8).to(dtype)
    return torch.randint(-100, 100, (6, 7, 8)).to(dtype)


def _changes(t: torch.Tensor) -> dict[str, torch.Tensor]:
    flipped = t.clone()
    flipped.view(torch.uint8).view(-1)[5] ^= 1
    return {
        "one bit": flipped,
        "rows swapped": t[:, [1, 0, *range(2, t.shape[1])]],
        "columns swapped": t[..., [1, 0, *range(2, t.shape[2])]],
        "zeroed": torch.zeros_like(t),
        "rotated by one": t.reshape(-1).roll(1).view(t.shape),
    }


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("method", [checksum, _sums], ids=["cpu-crc32", "device-sums"])
def test_checksum_sees_every_kind_of_change(dtype: torch.dtype, method: Any) -> None:
    t = _samples(dtype)
    same = t.clone()
    assert _equal(method(t), method(same))
    assert _equal(method(t.transpose(0, 2)), method(t.transpose(0, 2).contiguous()))
    for what, changed in _changes(t).items():
        if torch.equal(changed.view(torch.uint8) if dtype == torch.bool else changed, t):
            continue  # e.g. two equal bools swapped
        assert not _equal(method(t), method(changed)), what


@pytest.mark.parametrize("method", [checksum, _sums], ids=["cpu-crc32", "device-sums"])
def test_checksum_of_odd_shapes(method: Any) -> None:
    for t in (torch.tensor(3.0), torch.empty(0, 5), torch.arange(4096.0), torch.ones(1, 1, 1)):
        assert _equal(method(t), method(t.clone()))
    assert not _equal(method(torch.tensor(3.0)), method(torch.tensor(-3.0)))
    assert not _equal(method(torch.tensor(0.0)), method(torch.tensor(-0.0)))  # bits, not values


def _equal(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else bool(a == b)
