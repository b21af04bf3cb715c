"""The kept path in C (NOTE [ Fast path ] in tensorstash/core/_fastpath.py) against the Python one.

Gradients are checked against plain autograd; the C hooks' counts are checked
against the Python hooks' in the same process (the Python hooks are what the
C ones must match, not an oracle for gradients).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import assert_grads_equal, leak_check, run_case, top_saved_tensors_hooks
from zoo import ZOO

import tensorstash as ts
from tensorstash.core import _fastpath

compiled = _fastpath.compiled
needs_c = pytest.mark.skipif(compiled is None, reason="the C extension is not built")
slow = pytest.mark.slow
ROOT = Path(__file__).parent.parent
stash = importlib.import_module("tensorstash.stash")  # the module, not the function

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=["c", "python"])
def hooks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Sessions push the C hooks ("c", where built) or their Python hooks ("python")."""
    if request.param == "c" and compiled is None:
        pytest.skip("the C extension is not built")
    if request.param == "python":
        monkeypatch.setattr(stash, "compiled", None)
    return str(request.param)


def _counts(session: Any) -> dict[str, Any]:
    stats = session.stats
    kept = stats.tiers["kept"]
    return {
        "kept": (kept.tensors, kept.bytes, kept.peak_bytes, kept.live_bytes),
        "skipped": dict(stats.skipped),
        "deduplicated": stats.deduplicated,
        "unpacks": stats.unpacks,
        "tiers": {name: tier.tensors for name, tier in stats.tiers.items()},
    }


def test_extension_is_built_where_a_compiler_is() -> None:
    compiler = (sysconfig.get_config_var("CC") or "").split()
    if os.environ.get("TENSORSTASH_PURE_PYTHON") or not compiler or not shutil.which(compiler[0]):
        pytest.skip("no compiler here, or the extension is turned off")
    assert compiled is not None, "tensorstash.core._fast was not built: reinstall with a C compiler"


@needs_c
def test_sessions_push_c_hooks_unless_they_need_python() -> None:
    with ts.stash("keep", min_bytes=0):
        pack, unpack = top_saved_tensors_hooks()
        assert type(pack.__self__) is compiled.Hooks
        assert unpack.__self__ is pack.__self__
    for kwargs in ({"record": True}, {"verify": True}, {"profile": ts.Profile()}):
        with ts.stash("keep", min_bytes=0, **kwargs) as session:
            pack, _ = top_saved_tensors_hooks()
            assert pack == session.pack, kwargs
    assert top_saved_tensors_hooks() is None


def _match_params() -> list[Any]:
    """Every model, policy and ``min_bytes``; ``make test`` runs every model at ("keep", 0)
    and every policy and ``min_bytes`` on the transformer, ``make test-all`` the rest."""
    return [
        pytest.param(
            min_bytes,
            policy,
            name,
            id=f"{min_bytes}-{policy}-{name}",
            marks=() if name == "transformer" or (policy, min_bytes) == ("keep", 0) else slow,
        )
        for min_bytes in (0, 4096)
        for policy in ("keep", "auto", "lz4")
        for name in ZOO
    ]


@pytest.mark.parametrize(("min_bytes", "policy", "name"), _match_params())
def test_hooks_match_in_grads_and_counts(name: str, policy: str, min_bytes: int) -> None:
    expected = run_case(ZOO[name]())
    counts = {}
    for which in ("c", "python"):
        if which == "c" and compiled is None:
            continue
        with pytest.MonkeyPatch.context() as patch:
            if which == "python":
                patch.setattr(stash, "compiled", None)
            session = ts.stash(policy, min_bytes=min_bytes)
            assert_grads_equal(expected, run_case(ZOO[name](), session))
            leak_check(session)
            counts[which] = _counts(session)
    # Lz4 compresses in the background and learns from what it finished: its counts move
    # with timing, so only its gradients and leaks are compared.
    if len(counts) == 2 and policy != "lz4":
        assert counts["c"] == counts["python"]


def test_kept_tensor_changed_in_place_raises(hooks: str) -> None:
    for min_bytes in (0, 1 << 20):  # kept by the policy; kept under min_bytes
        x = torch.randn(64, requires_grad=True)
        with ts.stash("keep", min_bytes=min_bytes):
            y = x * 2
            z = y.sin()
        y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.sum().backward()


def test_storage_saved_twice_is_kept_once(hooks: str) -> None:
    x = torch.randn(256, requires_grad=True)
    with ts.stash("keep", min_bytes=0) as session:
        y = x * 2
        z = y.sin() + y.cos()  # both save y
    assert session.stats.tiers["kept"].tensors == 1
    assert session.stats.deduplicated == 1
    z.sum().backward()
    expected = (torch.cos(x * 2) - torch.sin(x * 2)) * 2
    assert torch.equal(x.grad, expected)


def test_parameters_and_buffers_stay_untouched(hooks: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32))
    with ts.stash("keep", min_bytes=0) as session:
        model(torch.randn(8, 32)).sum().backward()
    skipped = session.stats.skipped
    assert any("parameter" in text for text in skipped), skipped
    assert any("buffer" in text for text in skipped), skipped


def test_kept_bytes_freed_on_another_thread_leave_live(hooks: str) -> None:
    x = torch.randn(1024, requires_grad=True)
    with ts.stash("keep", min_bytes=0) as session:
        loss = (x * 2).sin().cos().sum()
    assert session.stats.tiers["kept"].live_bytes > 0
    holder = [loss]
    loss = None
    thread = threading.Thread(target=holder.clear)  # the graph dies on that thread
    thread.start()
    thread.join()
    assert session.stats.tiers["kept"].live_bytes == 0
    assert session.stats.live_bytes == 0


def test_selector_choice_other_than_keep_goes_to_its_policy(hooks: str) -> None:
    select = ts.Select(lambda tensor, memory: "lz4" if tensor.numel() >= 512 else "keep")
    x = torch.ones(1024, requires_grad=True)  # compressible
    expected = torch.autograd.grad((x * 2).sin().sum() + (x[:8] * 3).sin().sum(), x)[0]
    with ts.stash(select, min_bytes=0) as session:
        loss = (x * 2).sin().sum() + (x[:8] * 3).sin().sum()
    assert torch.equal(torch.autograd.grad(loss, x)[0], expected)
    assert session.stats.tiers["host"].tensors >= 1
    assert session.stats.tiers["kept"].tensors >= 1


def test_pause_pushes_back_the_hooks_it_popped(hooks: str) -> None:
    with ts.stash("keep", min_bytes=0):
        before = top_saved_tensors_hooks()
        with ts.pause():
            assert top_saved_tensors_hooks() is None
        assert top_saved_tensors_hooks() == before


@pytest.mark.slow  # a new Python process
def test_pure_python_env_turns_the_extension_off() -> None:
    code = (
        "import importlib; f = importlib.import_module('tensorstash.core._fastpath'); "
        "s = importlib.import_module('tensorstash.session.values'); print(f.compiled, s.Kept)"
    )
    env = {**os.environ, "TENSORSTASH_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "None" and "PyKept" in out.stdout


@pytest.mark.slow
@pytest.mark.skipif(compiled is None, reason="without the extension the suite runs pure already")
def test_core_suite_passes_in_pure_python() -> None:
    files = ["test_session.py", "test_autograd_cases.py", "test_stats.py", "test_fastpath.py"]
    env = {**os.environ, "TENSORSTASH_PURE_PYTHON": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    out = subprocess.run(
        [*command, *(str(ROOT / "tests" / name) for name in files)],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
