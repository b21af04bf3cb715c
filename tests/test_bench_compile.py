"""``tensorstash bench --compile``: every variant on the compiled model, the compiler's budgets
as peers (NOTE [ Compiled runs ] in tensorstash/bench/compiled.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tensorstash import bench, cli
from tensorstash.bench.compiled import CompiledForwards, compile_budget, offload_backend
from tensorstash.bench.variants import skip_reason
from tensorstash.core import _support

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(
        not torch._dynamo.is_dynamo_supported(), reason="torch.compile is not supported here"
    ),
]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Block(), _Block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).square().mean()


def _workload() -> bench.Workload:
    torch.manual_seed(0)
    return bench.Workload(_Model(), (torch.randn(32, 64, 64),), _Block, "a two-block MLP")


def test_compile_budget_reads_the_partitioners_budget() -> None:
    assert compile_budget("compile:0.25") == 0.25
    assert compile_budget("compile:0") == 0.0
    assert compile_budget("auto:50%") is None
    with pytest.raises(ValueError, match=r"from 0 .* to 1 .*got '1.5'"):
        compile_budget("compile:1.5")
    with pytest.raises(ValueError, match="got 'half'"):
        compile_budget("compile:half")


def test_compile_names_are_bench_policies_and_bad_ones_are_refused() -> None:
    assert bench.resolve_policies(["compile:0.5"]) == ["none", "compile:0.5"]
    with pytest.raises(ValueError, match="compile:<b>"):
        bench.resolve_policies(["compile:2"])


def test_bench_compile_runs_the_compilers_rows_that_policies_names_or_all() -> None:
    """Rule 9 of NOTE [ Compiled runs ]: each compiler's row is a compile of its own; a
    run that names some runs those only."""
    from tensorstash.bench.compiled import COMPILE_RUNS
    from tensorstash.bench.rounds import with_compile_rows

    every = with_compile_rows(["none", "auto"], compile=True)
    assert every == ["none", "auto", *COMPILE_RUNS]
    named = ["none", "auto:50%", bench.COMPILE_OFFLOAD]
    assert with_compile_rows(named, compile=True) == named
    assert with_compile_rows(["none", "auto"], compile=False) == ["none", "auto"]
    one = bench.planned_steps(["none", "compile:0.5"], steps=2, warmup=1, compile=True)
    assert one == 2 + 2 * (1 + 2)  # reference and activations, then two variants' rounds


def test_compiled_forwards_share_one_compiled_model_and_one_per_budget() -> None:
    model = _Model()
    forwards = CompiledForwards(model, compile=True)
    assert forwards("none") is forwards("auto:50%") is forwards("keep")
    assert forwards("compile:0.5") is forwards("compile:0.5")
    assert forwards("compile:0.5") is not forwards("compile:0.1") is not forwards("none")
    eager = CompiledForwards(model, compile=False)
    assert eager("none") is model and eager("compile:0.5") is not model


def test_compile_offload_is_the_default_partitioner_and_needs_cuda() -> None:
    assert compile_budget(bench.COMPILE_OFFLOAD) == 1.0
    assert bench.resolve_policies([bench.COMPILE_OFFLOAD]) == ["none", bench.COMPILE_OFFLOAD]
    reason = skip_reason(bench.COMPILE_OFFLOAD, torch.device("cpu"), compiled=True)
    assert reason is not None and "the host is the device" in reason
    on_cuda = skip_reason(bench.COMPILE_OFFLOAD, torch.device("cuda"), compiled=True)
    assert on_cuda == _support.missing(_support.OFFLOAD)  # None from torch 2.10


@pytest.mark.slow
def test_bench_compile_reports_a_compiler_offload_that_fails_as_skipped_with_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule 8 of NOTE [ Compiled runs ]: ``compile:offload`` is an optional peer; where it
    fails to compile (its stream ops on an older torch), its row says so and the bench
    goes on (it runs here as it would on CUDA: its reason to skip on the CPU is put aside,
    and the other rows compile with aot_eager, quicker than inductor)."""
    from tensorstash.bench import compiled, rounds

    def failing(options: Any = None) -> Any:
        def backend(graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
            raise RuntimeError("stream 3 is not in the stream table")

        return backend

    def quick(self: Any, model: nn.Module, backend: Any = None) -> Any:
        return torch.compile(model, backend=backend or "aot_eager")

    monkeypatch.setattr(rounds, "skip_reason", lambda name, device, **where: None)
    monkeypatch.setattr(compiled, "offload_backend", failing)
    monkeypatch.setattr(compiled.CompileOptions, "compile", quick)
    rows = bench.run_bench(
        policies=["none", "keep", bench.COMPILE_OFFLOAD],
        steps=1,
        warmup=1,
        workload=_workload(),
        compile=True,
    )
    by_name = {row.policy: row for row in rows}
    assert by_name["none"].grads_equal and by_name["keep"].grads_equal
    skipped = by_name[bench.COMPILE_OFFLOAD].skipped or ""
    assert skipped.startswith("failed: ") and "stream 3 is not in the stream table" in skipped
    assert "skipped: failed: " in bench.format_table(rows)


def test_compile_offload_marks_the_forward_and_trains_as_the_compiled_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule 8 as far as the CPU goes: the partitioner offloads what the pass marked (a copy
    to the device it is on) and the gradients are the compiled model's alone, bitwise."""
    if _support.missing(_support.OFFLOAD):
        pytest.skip(_support.missing(_support.OFFLOAD))
    import torch._functorch._activation_offloading.activation_offloading as offloading
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    chosen: list[int] = []
    choose = offloading.choose_offload_sets

    def counted(fwd: torch.fx.GraphModule, *args: Any) -> bool:
        found = choose(fwd, *args)
        chosen.append(sum(1 for n in fwd.graph.nodes if n.meta.get("saved_for_offloading")))
        return found

    monkeypatch.setattr(offloading, "choose_offload_sets", counted)
    torch.manual_seed(0)
    model, x = _Block(), torch.randn(32, 64)
    grads = []
    with (
        functorch_config.patch(enable_autograd_cache=False),
        inductor_config.patch(fx_graph_cache=False),
    ):
        for backend in (None, offload_backend()):
            compiled = torch.compile(model, backend=backend) if backend else torch.compile(model)
            model.zero_grad(set_to_none=True)
            compiled(x).square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            torch._dynamo.reset()
    assert chosen and chosen[-1] > 0  # what the compiler alone never offloads
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.fixture(scope="module")
def compiled_rows() -> dict[str, bench.Row]:
    rows = bench.run_bench(
        policies=["none", "keep", "checkpoint", "auto"],
        steps=2,
        warmup=2,
        workload=_workload(),
        compile=True,
    )
    return {row.policy: row for row in rows}


@pytest.mark.slow
def test_bench_compile_runs_the_compilers_budgets_beside_the_variants(
    compiled_rows: dict[str, bench.Row],
) -> None:
    names = ["none", "keep", "checkpoint", "auto", *bench.COMPILE_PEERS, bench.COMPILE_OFFLOAD]
    assert list(compiled_rows) == names
    assert all(row.skipped is None for row in compiled_rows.values() if row.policy in names[:-1])
    assert "the host is the device" in (compiled_rows[bench.COMPILE_OFFLOAD].skipped or "")


@pytest.mark.slow
def test_bench_compile_grads_equal_the_compiled_model_alone(
    compiled_rows: dict[str, bench.Row],
) -> None:
    """Lossless variants around the compiled model: bitwise; the compiler's own budgets
    recompute and may fuse another way, so they are held within float tolerance."""
    for name in ("none", "keep", "auto", "compile:1.0"):
        assert compiled_rows[name].grads_equal, name
    for name in bench.COMPILE_PEERS:
        assert compiled_rows[name].grads_close, name


@pytest.mark.slow
def test_bench_compile_counts_graphs_apart_from_the_timed_steps(
    compiled_rows: dict[str, bench.Row],
) -> None:
    """Rule 5: each budget compiles its own graphs in warm-up; no timed step compiles."""
    for name in bench.COMPILE_PEERS:
        row = compiled_rows[name]
        assert row.graphs >= 1 and row.compile_s is not None, name
    assert all(row.timed_graphs == 0 for row in compiled_rows.values())
    table = bench.format_table(list(compiled_rows.values()))
    assert "graphs compiled (warm-up steps, time beyond a step): " in table
    assert "recompile loop" not in table


@pytest.mark.slow
def test_bench_compile_rows_reach_the_json(
    compiled_rows: dict[str, bench.Row], tmp_path: Path
) -> None:
    data: list[dict[str, Any]] = json.loads(
        json.dumps([row.to_dict() for row in compiled_rows.values()])
    )
    peer = next(row for row in data if row["policy"] == "compile:0.5")
    assert {"graphs", "timed_graphs", "compile_s", "grads_close"} <= set(peer)
    assert bench.Row.from_dict(peer) == compiled_rows["compile:0.5"]
    auto = next(row for row in data if row["policy"] == "auto")
    assert auto["plan_compiler"] == "nothing (the compiled graphs keep what fits)"
    assert peer["plan_compiler"] is None
    table = bench.format_table(list(compiled_rows.values()))
    assert "auto: the compiler is asked for nothing" in table


def test_bench_compile_title_says_compiled() -> None:
    title = bench.format_title("m", "cpu", "float32", [], threads=1, warmup=2, compiled=True)
    assert "torch.compile (inductor), deterministic algorithms" in title


def test_bench_compile_with_loop_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--model", "tiny", "--compile", "--loop", "8"])
    assert "leave out --compile" in capsys.readouterr().err


# -- How --compile compiles: torch.compile's mode, fullgraph and dynamic shapes --------------


def test_compile_options_refuse_cuda_graph_modes_off_cuda() -> None:
    from tensorstash.bench.compiled import CompileOptions

    CompileOptions(mode="max-autotune-no-cudagraphs").check(torch.device("cpu"))
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(ValueError, match=rf"{mode} records CUDA graphs.*--device cuda"):
            CompileOptions(mode=mode).check(torch.device("cpu"))
        CompileOptions(mode=mode).check(torch.device("cuda"))
    with pytest.raises(ValueError, match=r"'fast' is not one of torch\.compile's"):
        CompileOptions(mode="fast")


def test_compile_options_reach_torch_compile() -> None:
    """fullgraph=True: a graph break is an error, in the compiled model and in the peers."""
    from tensorstash.bench.compiled import CompileOptions

    class Breaking(_Model):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch._dynamo.graph_break()
            return super().forward(x)

    forwards = CompiledForwards(Breaking(), CompileOptions(fullgraph=True, dynamic=True))
    assert (
        forwards.compile
        and forwards.options.describe() == "mode default, fullgraph, dynamic shapes"
    )
    try:
        for name in ("none", "compile:0.5"):
            with pytest.raises(torch._dynamo.exc.Unsupported):
                forwards(name)(torch.randn(4, 64))
    finally:
        torch._dynamo.reset()


def test_compiled_forwards_refuse_a_cuda_graph_mode_for_a_model_on_the_cpu() -> None:
    from tensorstash.bench.compiled import CompileOptions

    with pytest.raises(ValueError, match="reduce-overhead records CUDA graphs"):
        CompiledForwards(_Model(), CompileOptions(mode="reduce-overhead"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fullgraph"], "--fullgraph say how to compile; add --compile"),
        (["--compile-mode", "default", "--dynamic"], "--compile-mode, --dynamic say how"),
        (["--compile", "--compile-mode", "reduce-overhead"], "records CUDA graphs"),
        (["--compile", "--compile-mode", "fast"], "invalid choice: 'fast'"),
    ],
)
def test_bench_compile_flags_are_usage_errors_where_they_cannot_run(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--model", "tiny", *flags])
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_bench_compile_runs_with_fullgraph_and_dynamic_shapes() -> None:
    """Every variant that keeps to one graph runs with fullgraph=True and dynamic shapes."""
    from tensorstash.bench.compiled import CompileOptions

    rows = bench.run_bench(
        policies=["none", "keep", "auto", "auto:50%"],
        steps=2,
        warmup=2,
        workload=_workload(),
        compile=CompileOptions(fullgraph=True, dynamic=True),
    )
    assert all(row.skipped is None for row in rows if row.policy != bench.COMPILE_OFFLOAD)
    assert all(row.grads_equal for row in rows if not row.policy.startswith("compile:"))


@pytest.mark.slow
def test_bench_compile_checkpoint_the_hf_way_compiles_nothing_after_warm_up() -> None:
    """ "checkpoint" on an HF model runs a copy whose checkpointing was turned on once:
    turned on and off every step, HF stacked a hook on the input embeddings each time and
    made a new function the graphs guard on, and every variant compiled again each step."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from tensorstash.bench import workloads
    from tensorstash.bench.compiled import compiled_run
    from tensorstash.bench.hf import hf_checkpointing

    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    library_model = transformers.GPT2LMHeadModel(config)
    library_model.loss_type = "ForCausalLM"
    workload = bench.Workload(
        workloads.CausalLMLoss(library_model),
        (torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0)),),
        GPT2Block,
        "a two-layer HF GPT-2",
        checkpointing=hf_checkpointing,
        library_model=library_model,
    )
    hooks = len(library_model.get_input_embeddings()._forward_hooks)
    with compiled_run(True):
        runner = bench.StepRunner(workload, torch.device("cpu"), torch.float32, 0, compile=True)
        runner.take_reference()  # "none" and "keep" compile their graphs
        assert runner.step("checkpoint").graphs > 0
        # The copy's graphs, which break where checkpointing starts, are not found for the
        # shared model: "none" and "keep" run the graphs the reference ran.
        steps = [runner.step(name) for name in ("none", "keep", "checkpoint") * 2]
    assert [step.graphs for step in steps] == [0] * 6
    assert all(step.grads_equal for step in steps)
    assert len(library_model.get_input_embeddings()._forward_hooks) == hooks
