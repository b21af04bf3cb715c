"""``make gpu-check``: the first thing to run on a machine with a CUDA device.

It needs a Python whose torch sees the GPU (``pip install torch`` and nothing else) and
uses the standard library only. It installs tensorstash where that torch is: into the
virtual environment the Python runs in, or else into ``.gpu-venv``, made beside the
clone with the system's packages visible (torch and its CUDA libraries are not copied).
What the checks need besides (pytest, lz4, psutil, xxhash, transformers, ...) comes
from ``gpu-wheels/`` where that folder is (``make gpu-wheels`` fills it on a machine
that reaches PyPI, for a GPU machine that does not), else from the package index.
tensorstash's C extensions build against that torch where a compiler is present.

Then, each phase within its share of the time (``--budget-s``, 7.75 minutes in all,
setup included, so the check fits in 8 minutes of device time):

1. ``cuda-tests``: every test marked ``cuda`` (``pytest -m cuda``);
2. ``large-eager``: ``tensorstash bench`` on the embedded ``large`` model;
3. ``llama-eager``: the bench on a Hugging Face Llama (benchmarks/hf_llama.py), under
   bf16 autocast;
4. ``large-compile``, 5. ``llama-compile``: both again with ``--compile``, beside the
   compiler's own offload (``compile:offload``), the Llama with ``Auto``'s search over
   the partitioner's settings too.

Each phase writes its output (for the benches, the table, and its JSON) into the out
folder (``gpu-out/``); ``summary.txt`` there says which torch and GPU ran, and how each
phase ended and how long it took. A phase whose time runs out is stopped (the tests'
log shows how far they got). ``--only`` runs some phases, ``--budget-s`` gives each a
share of a longer check; ``--cpu`` runs the same phases on small models on the CPU, to
check the script itself on a machine without a GPU.

Example:
    python3 benchmarks/gpu_check.py            # or: make gpu-check
    python3 benchmarks/gpu_check.py --only cuda-tests,large-eager --out /tmp/gpu-out
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 465.0
"""The whole check, setup included: 7.75 minutes, within 8 minutes of device time."""
SETUP_S = 150.0
"""The most the setup may take (an install from the package index; from gpu-wheels/ and
with a compiler at hand it takes well under a minute)."""
NEEDED = {
    "psutil": "psutil",
    "lz4": "lz4",
    "xxhash": "xxhash",
    "pytest": "pytest",
    "pytest_timeout": "pytest-timeout",
    "hypothesis": "hypothesis",
    "tqdm": "tqdm",
    "numpy": "numpy",
    "transformers": "transformers",
}
"""What the phases import (module: package), besides torch."""
CORE = ("psutil", "lz4", "xxhash")
"""Without these tensorstash does not import: no phase can run."""


@dataclasses.dataclass(frozen=True)
class Phase:
    """One step of the check: its name, its share of the time, and the arguments of the
    Python that runs it (``{out}`` is the out folder)."""

    name: str
    budget_s: float
    args: tuple[str, ...]
    needs: tuple[str, ...] = ()


def _bench(name: str, *args: str) -> tuple[str, ...]:
    return (
        "-c",
        "import sys; from tensorstash.cli import main; sys.exit(main(sys.argv[1:]))",
        "bench",
        *args,
        "--json",
        f"{{out}}/{name}.json",
    )


def phases(cpu: bool) -> tuple[Phase, ...]:
    """The phases, in the order they run (the most telling first, should time run out).

    Budgeted for an H100 or H200 with 16 CPU threads: an eager step of ``large`` takes
    half a second there, and each compile of it takes longer than the steps do, so the
    compiled ``large`` runs the compiled model and the compiler's offload only; the
    compiled Llama, smaller, runs Auto's search over the partitioner's settings (four
    compiles) beside them.
    """
    device = ("--device", "cpu" if cpu else "cuda")
    large = ("--model", "tiny") if cpu else ("--model", "large")
    llama = ("--model-script", f"benchmarks/hf_llama.py:{'tiny' if cpu else 'make'}")
    bf16 = ("--dtype", "bfloat16")
    steps = ("--steps", "1" if cpu else "2", "--warmup", "1" if cpu else "2")
    tests = ("-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rfEs")
    offload = ("--compile", "--policies", "none,compile:offload")
    search = ("--compile", "--policies", "none,auto:50%,compile:offload")
    return (
        Phase("cuda-tests", 120, (*tests, "--junitxml={out}/cuda-tests.xml", "tests"), ("pytest",)),
        Phase(
            "large-eager",
            40,
            _bench("large-eager", *large, *device, "--policies", "none,cpu,auto:50%", *steps),
        ),
        Phase(
            "llama-eager",
            30,
            _bench(
                "llama-eager", *llama, *device, *bf16, "--policies", "none,cpu,auto:50%", *steps
            ),
            ("transformers",),
        ),
        Phase("large-compile", 95, _bench("large-compile", *large, *device, *offload, *steps)),
        Phase(
            "llama-compile",
            150,
            _bench("llama-compile", *llama, *device, *bf16, *search, *steps),
            ("transformers",),
        ),
    )


class Summary:
    """What ran, and how it ended: printed, and written to ``summary.txt`` as it goes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[str] = []

    def say(self, line: str) -> None:
        print(f"gpu-check: {line}", flush=True)
        self.lines.append(line)
        self.path.write_text("\n".join(self.lines) + "\n")


def run(
    args: Sequence[str], log: Path, timeout_s: float, env: dict[str, str], echo: bool = True
) -> tuple[int | None, float]:
    """Run ``args`` (its output to ``log``, and to the console), stopped with its process
    group after ``timeout_s``: its exit status (None: stopped) and seconds."""
    start = time.monotonic()
    with log.open("w") as sink:
        process = subprocess.Popen(
            list(args),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

        def copy() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                sink.write(line)
                sink.flush()
                if echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        try:
            code: int | None = process.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
        reader.join(timeout=10)
    return code, time.monotonic() - start


def probe(python: str, code: str, env: dict[str, str] | None = None) -> str | None:
    """What ``python -c code`` prints, or None where it fails."""
    found = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=False
    )
    return found.stdout.strip() if found.returncode == 0 else None


def setup(base: str, venv: Path, wheels: Path, out: Path, summary: Summary) -> tuple[str, dict]:
    """Where tensorstash runs: the Python of the environment it is installed into, and the
    environment variables of the phases. Exits where torch cannot run the check."""
    env = dict(os.environ)
    deadline = time.monotonic() + SETUP_S
    if probe(base, "import sys; print(int(sys.prefix != sys.base_prefix))") == "1":
        python = base  # already a virtual environment: its own packages, torch among them
    else:
        python = str(venv / "bin" / "python")
        if not Path(python).exists():
            made = subprocess.run(
                [base, "-m", "venv", "--system-site-packages", str(venv)], check=False
            )
            if made.returncode != 0:
                summary.say(
                    f"setup: could not make {venv} with {base} -m venv; pass --python a "
                    "virtual environment's Python that has torch (tensorstash installs there)"
                )
                raise SystemExit(2)
    pip = [python, "-m", "pip", "--disable-pip-version-check", "install"]
    source = ["--no-index", "--find-links", str(wheels)] if wheels.is_dir() else []
    missing = probe(
        python,
        "import importlib.util as u; "
        f"print(' '.join(n for n in {list(NEEDED)!r} if u.find_spec(n) is None))",
    )
    packages = [NEEDED[name] for name in (missing or "").split()]
    old = probe(
        python,
        "from importlib.metadata import version; "
        "print(int(int(version('setuptools').split('.')[0]) < 77))",
    )
    if old != "0":
        packages.append("setuptools>=77")  # the license field of pyproject.toml
    if packages:
        code, seconds = run(
            [*pip, *source, *packages],
            out / "setup-packages.txt",
            deadline - time.monotonic(),
            env,
        )
        summary.say(
            f"setup: installed {' '.join(packages)} from "
            f"{wheels if source else 'the package index'}: "
            f"{'ok' if code == 0 else 'failed'} ({seconds:.0f} s)"
        )
    code, seconds = run(
        [*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)],
        out / "setup-tensorstash.txt",
        deadline - time.monotonic(),
        env,
    )
    if code != 0:  # run from the clone: no C extensions, which info() will say
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        summary.say(
            "setup: tensorstash did not install (setup-tensorstash.txt); runs from the clone"
        )
    absent = probe(
        python,
        "import importlib.util as u; "
        f"print(' '.join(n for n in {list(NEEDED)!r} if u.find_spec(n) is None))",
        env,
    )
    if absent is None or any(name in (absent or "").split() for name in CORE):
        summary.say(f"setup: tensorstash cannot import here (missing: {absent}); stopped")
        raise SystemExit(2)
    env["GPU_CHECK_ABSENT"] = absent
    return python, env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-out", help="the folder of the logs and tables")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole check")
    parser.add_argument("--only", default=None, help="comma-separated phases to run")
    parser.add_argument("--cpu", action="store_true", help="small models on the CPU")
    parser.add_argument("--python", default=sys.executable, help="the Python whose torch runs")
    parser.add_argument("--venv", default=str(ROOT / ".gpu-venv"))
    parser.add_argument("--wheels", default=str(ROOT / "gpu-wheels"))
    args = parser.parse_args(argv)
    start = time.monotonic()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary = Summary(out / "summary.txt")
    torch_line = probe(
        args.python,
        "import torch; c = torch.cuda.is_available(); "
        "print(torch.__version__, 'cuda' if c else 'no-cuda', "
        "torch.cuda.get_device_name() if c else '-')",
    )
    if torch_line is None:
        summary.say(f"{args.python} cannot import torch: install it first (pip install torch)")
        return 2
    version, cuda, *name = torch_line.split(" ")
    if cuda != "cuda" and not args.cpu:
        summary.say(f"torch {version} sees no CUDA device; pass --cpu to check the script alone")
        return 2
    summary.say(f"torch {version} on {' '.join(name) if cuda == 'cuda' else 'the CPU'}")
    python, env = setup(args.python, Path(args.venv), Path(args.wheels), out, summary)
    info = probe(python, "import tensorstash; print(tensorstash.info().line())", env)
    summary.say(f"{info}; setup took {time.monotonic() - start:.0f} s")
    chosen = [name for name in (args.only or "").split(",") if name]
    known = {phase.name: phase for phase in phases(args.cpu)}
    unknown = [name for name in chosen if name not in known]
    if unknown:
        summary.say(f"unknown phase {unknown[0]!r}; the phases are {', '.join(known)}")
        return 2
    absent = set(env.pop("GPU_CHECK_ABSENT", "").split())
    failed = False
    for phase in known.values():
        if chosen and phase.name not in chosen:
            continue
        left = args.budget_s - (time.monotonic() - start)
        lacking = [need for need in phase.needs if need in absent]
        if lacking:
            summary.say(f"{phase.name}: skipped, {', '.join(lacking)} not installed")
            continue
        if left < 10:
            summary.say(f"{phase.name}: skipped, no time left")
            continue
        command = [python, *(arg.replace("{out}", str(out)) for arg in phase.args)]
        share = phase.budget_s * args.budget_s / BUDGET_S  # a longer check: longer phases
        code, seconds = run(command, out / f"{phase.name}.txt", min(share, left), env)
        ended = "ok" if code == 0 else "stopped: out of time" if code is None else f"exit {code}"
        failed = failed or code != 0
        summary.say(f"{phase.name}: {ended} ({seconds:.0f} s); output in {phase.name}.txt")
    summary.say(f"done in {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
