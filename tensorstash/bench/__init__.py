"""``tensorstash bench``: the embedded model, workloads, variants, measurements, report.

The modules, in the order they import each other:

- :mod:`~tensorstash.bench.model`: the embedded GPT-style model and its sizes;
- :mod:`~tensorstash.bench.workloads`: what the bench trains (that model, or a user's);
- :mod:`~tensorstash.bench.variants`: the policies and peers the bench compares;
- :mod:`~tensorstash.bench.measure`: one step's time, memory and gradients;
- :mod:`~tensorstash.bench.report`: the rows and the table;
- :mod:`~tensorstash.bench.rounds`: NOTE [ Fair comparison ] and :func:`run_bench`;
- :mod:`~tensorstash.bench.plot`: the figure of ``--plot``.
"""

from tensorstash.bench.measure import (
    DTYPES,
    PeakRss,
    StepResult,
    StepRunner,
    Timeline,
    resolve_device,
    resolve_dtype,
    return_free_memory,
)
from tensorstash.bench.model import (
    CONFIGS,
    BenchGPT,
    Block,
    ModelConfig,
    make_batch,
    resolve_config,
)
from tensorstash.bench.report import PlanEffect, Row, format_table
from tensorstash.bench.rounds import (
    check_memory_snapshot,
    planned_steps,
    run_bench,
    snapshot_file,
)
from tensorstash.bench.variants import (
    ALL_POLICIES,
    AUTO_PREFIX,
    BASELINE,
    DEFAULT_POLICIES,
    NEEDS_BLOCKS,
    NO_PLAN,
    PEERS,
    check_blocks,
    resolve_policies,
    variant_context,
)
from tensorstash.bench.workloads import (
    MODEL_SCRIPT_PROTOCOL,
    Batch,
    ModelScriptError,
    Workload,
    builtin_workload,
    script_workload,
)

__all__ = [
    "ALL_POLICIES",
    "AUTO_PREFIX",
    "BASELINE",
    "CONFIGS",
    "DEFAULT_POLICIES",
    "DTYPES",
    "MODEL_SCRIPT_PROTOCOL",
    "NEEDS_BLOCKS",
    "NO_PLAN",
    "PEERS",
    "Batch",
    "BenchGPT",
    "Block",
    "ModelConfig",
    "ModelScriptError",
    "PeakRss",
    "PlanEffect",
    "Row",
    "StepResult",
    "StepRunner",
    "Timeline",
    "Workload",
    "builtin_workload",
    "check_blocks",
    "check_memory_snapshot",
    "format_table",
    "make_batch",
    "planned_steps",
    "resolve_config",
    "resolve_device",
    "resolve_dtype",
    "resolve_policies",
    "return_free_memory",
    "run_bench",
    "script_workload",
    "snapshot_file",
    "variant_context",
]
