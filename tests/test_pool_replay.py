"""The session pool's races, replayed step by step (NOTE [ Session pool ] in
tensorstash/memory/_pool.py, rule 10).

``tests/pool_replay.cpp`` builds the pool's source, unchanged, into a harness whose
``mmap`` and ``mremap`` do on cue what the kernel may do: a grow's ``mremap`` moves the
block and parks its thread before it takes the pool's lock again, and another thread's
new block lands in the range the grow left. Each case runs in a process of its own: a
pool that loses a block's record hands it to ``free()``, and glibc aborts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cxx import build, compiler

import tensorstash.memory

SOURCE = Path(tensorstash.memory.__file__).with_name("_alloc.cpp")
HARNESS = Path(__file__).with_name("pool_replay.cpp")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the session pool is Linux only"
)


@pytest.fixture(scope="module")
def harness() -> Path:
    """The folder holding ``_pool_replay``, the pool's source built into the harness."""
    if compiler() is None:
        pytest.skip("no C++ compiler ($CXX or g++): the replay builds the pool's source")
    if not SOURCE.exists():
        pytest.skip(f"the pool's source is not installed beside the package ({SOURCE})")
    pool = SOURCE.read_text()
    flags = [
        f"-DTENSORSTASH_POOL_SOURCE={json.dumps(str(SOURCE))}",
        '-DTENSORSTASH_TORCH_VERSION="replay"',
    ]
    try:
        return build("_pool_replay", HARNESS.read_text(), flags, key=pool)
    except subprocess.CalledProcessError as error:
        raise AssertionError(
            f"the replay harness does not build:\n{error.stderr[-4000:]}"
        ) from None


def replay(harness: Path, case: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(harness), os.environ.get("PYTHONPATH", "")])
    )
    code = f"import torch, _pool_replay; print(_pool_replay.run({case!r}))"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )


def said(done: subprocess.CompletedProcess[str]) -> str:
    code = done.returncode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
    return f"{how}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_a_block_mapped_where_a_grow_moved_from_keeps_its_record(harness: Path) -> None:
    # The grow erased the old address from the books only after mremap had freed its
    # range; a miss mapped there meanwhile lost its record, and its free went to free().
    done = replay(harness, "miss")
    assert done.returncode == 0 and done.stdout.strip() == "ok", said(done)


def test_a_block_grown_where_another_grow_moved_from_keeps_its_record(harness: Path) -> None:
    done = replay(harness, "grow")
    assert done.returncode == 0 and done.stdout.strip() == "ok", said(done)


def test_an_address_recorded_twice_stops_the_process_naming_the_bug(harness: Path) -> None:
    # An address the books hold already, mapped anew (the harness's mmap returns a block
    # in use), would overwrite that block's record: the process aborts first.
    done = replay(harness, "twice")
    assert done.returncode == -signal.SIGABRT, said(done)
    assert "an address mapped anew is recorded already" in done.stderr, said(done)
    assert "this is a bug in tensorstash" in done.stderr, said(done)
