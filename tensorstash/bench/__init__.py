"""``tensorstash bench``: the embedded model, workloads, variants, measurements, report.

The modules, each importing only those above it:

- :mod:`~tensorstash.bench.model`: the embedded GPT-style model and its sizes;
- :mod:`~tensorstash.bench.hf`: NOTE [ HF peers ], Hugging Face's own checkpointing
  and offload (transformers imported lazily);
- :mod:`~tensorstash.bench.workloads`: what the bench trains (that model, an HF
  GPT-2); :mod:`~tensorstash.bench.script`: a user's model (``--model-script``);
- :mod:`~tensorstash.bench.compiled`: NOTE [ Compiled runs ], ``--compile`` and the
  compiler's own budgets (``compile:<b>``);
- :mod:`~tensorstash.bench.variants`: the policies and peers the bench compares;
- :mod:`~tensorstash.memory._memory` (shared with the Profile): NOTE [ Real memory ], a step's
  real peak;
- :mod:`~tensorstash.bench.timeline`: memory over one step, for ``--plot``;
- :mod:`~tensorstash.bench.measure`: one step's time, memory, gradients and plan;
- :mod:`~tensorstash.bench.rows`: a variant's result, medians of same-round ratios;
- :mod:`~tensorstash.bench.report`: the table;
- :mod:`~tensorstash.bench.snapshot`: ``--memory-snapshot`` (CUDA);
- :mod:`~tensorstash.bench.rounds`: NOTE [ Fair comparison ], :func:`run_bench`
  and :func:`run_sweep`;
- :mod:`~tensorstash.bench.plot`: the figure of ``--plot`` (matplotlib, imported lazily);
- :mod:`~tensorstash.bench.loop`: ``--loop``, NOTE [ Training loops ]: each variant
  trained alone in a fresh process.
"""

from tensorstash.bench.compiled import (
    COMPILE_OFFLOAD,
    COMPILE_PEERS,
    COMPILE_PREFIX,
    compile_budget,
)
from tensorstash.bench.hf import HF_EVERY_PREFIX, HF_OFFLOAD, HF_PEERS, hf_model, is_hf_peer
from tensorstash.bench.measure import DTYPES, StepResult, StepRunner, resolve_device, resolve_dtype
from tensorstash.bench.model import (
    CONFIGS,
    BenchGPT,
    Block,
    ModelConfig,
    make_batch,
    resolve_config,
)
from tensorstash.bench.report import format_table, format_title
from tensorstash.bench.rounds import planned_steps, run_bench, run_sweep
from tensorstash.bench.rows import PlanEffect, Row, pareto_front
from tensorstash.bench.script import MODEL_SCRIPT_PROTOCOL, script_workload
from tensorstash.bench.snapshot import check_memory_snapshot, snapshot_file
from tensorstash.bench.timeline import Timeline
from tensorstash.bench.variants import (
    ALL_POLICIES,
    AUTO_PREFIX,
    BASELINE,
    DEFAULT_POLICIES,
    NEEDS_BLOCKS,
    NO_PLAN,
    OPTIONAL_PEERS,
    PEERS,
    SWEEP_POLICIES,
    budget_bytes,
    check_blocks,
    default_policies,
    limit_bytes,
    needs_blocks,
    resolve_policies,
    skip_reason,
    variant_context,
)
from tensorstash.bench.workloads import (
    HF_GPT2,
    MODELS,
    Batch,
    ModelScriptError,
    Workload,
    WorkloadUnavailable,
    builtin_workload,
)
from tensorstash.memory._memory import CudaPeak, PeakRss, return_free_memory

__all__ = [
    "ALL_POLICIES",
    "AUTO_PREFIX",
    "BASELINE",
    "COMPILE_OFFLOAD",
    "COMPILE_PEERS",
    "COMPILE_PREFIX",
    "CONFIGS",
    "DEFAULT_POLICIES",
    "DTYPES",
    "HF_EVERY_PREFIX",
    "HF_GPT2",
    "HF_OFFLOAD",
    "HF_PEERS",
    "MODELS",
    "MODEL_SCRIPT_PROTOCOL",
    "NEEDS_BLOCKS",
    "NO_PLAN",
    "OPTIONAL_PEERS",
    "PEERS",
    "SWEEP_POLICIES",
    "Batch",
    "BenchGPT",
    "Block",
    "CudaPeak",
    "ModelConfig",
    "ModelScriptError",
    "PeakRss",
    "PlanEffect",
    "Row",
    "StepResult",
    "StepRunner",
    "Timeline",
    "Workload",
    "WorkloadUnavailable",
    "budget_bytes",
    "limit_bytes",
    "builtin_workload",
    "check_blocks",
    "check_memory_snapshot",
    "compile_budget",
    "default_policies",
    "format_table",
    "format_title",
    "hf_model",
    "is_hf_peer",
    "make_batch",
    "needs_blocks",
    "pareto_front",
    "planned_steps",
    "resolve_config",
    "resolve_device",
    "resolve_dtype",
    "resolve_policies",
    "return_free_memory",
    "run_bench",
    "run_sweep",
    "script_workload",
    "skip_reason",
    "snapshot_file",
    "variant_context",
]
