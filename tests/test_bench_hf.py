"""The bench's HF peers (NOTE [ HF peers ]): HF's checkpointing of one layer in k
(``hf-every:<k>``) and with offload (``hf-offload``), on a model script with LoRA adapters,
beside "checkpoint", TRL's offloader and the stash; skipped with a reason where they do
not apply. Nothing here asserts a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorstash import bench
from tensorstash.bench import hf, variants
from tensorstash.cli import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXAMPLES = Path(__file__).parent.parent / "examples"

SCRIPT = """
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


class Loss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, labels=input_ids).loss


def base():
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model


def make():
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(base(), lora)
    return Loss(model), (torch.randint(128, (2, 64)),), LlamaDecoderLayer


def without_blocks():
    model, batch, _ = make()
    return model, batch
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("script") / "lora_script.py"
    path.write_text(SCRIPT)
    return path


@pytest.fixture(scope="module")
def run(script: Path, tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> Any:
    """One CLI run on the LoRA script with every peer, its JSON rows and its plot."""
    out = tmp_path_factory.mktemp("bench")
    policies = "checkpoint,hf-every:2,hf-every:1,hf-offload,trl,disk,auto:50%"
    argv = ["bench", "--model-script", f"{script}:make", "--steps", "2", "--warmup", "0"]
    argv += ["--policies", policies, "--json", str(out / "rows.json")]
    argv += ["--plot", str(out / "bench.png")]
    assert main(argv) == 0
    rows = {row["policy"]: row for row in json.loads((out / "rows.json").read_text())}
    return rows, out / "bench.png"


def test_hf_peers_run_on_a_lora_script_with_equal_grads(run: Any) -> None:
    rows, _ = run
    assert list(rows) == [
        "none", "checkpoint", "hf-every:2", "hf-every:1", "hf-offload", "trl", "disk", "auto:50%",
    ]  # fmt: skip
    for name in ("none", "checkpoint", "hf-every:2", "hf-every:1", "disk", "auto:50%"):
        row = rows[name]
        assert row["skipped"] is None and row["grads_equal"] is True, name
        assert len(row["step_times"]) == 2 and row["real_peak_bytes"] is not None, name
    for name in ("checkpoint", "hf-every:2", "hf-every:1"):
        assert rows[name]["tiers"] is None  # a peer, not a stash


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU hf-offload and trl run")
def test_hf_offload_and_trl_are_skipped_on_the_cpu_with_the_reason(run: Any) -> None:
    rows, _ = run
    assert "on the cpu the host is the device" in rows["hf-offload"]["skipped"]
    assert rows["trl"]["skipped"] == "needs CUDA streams (a GPU run)"
    assert rows["hf-offload"]["grads_equal"] is None


def test_hf_peer_rows_are_in_the_plot(run: Any) -> None:
    _, png = run
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_hf_every_k_checkpoints_one_layer_in_k_on_a_copy(script: Path) -> None:
    workload = bench.script_workload(f"{script}:make", seed=0)
    runner = bench.StepRunner(workload, torch.device("cpu"), torch.float32, seed=0)
    library = bench.hf_model(runner.model)
    embeddings = library.get_input_embeddings()
    hooks = len(embeddings._forward_hooks)

    def flags(name: str) -> list[bool]:
        copy = bench.hf_model(runner.model_for(name).model)
        assert copy is not library
        return [layer.gradient_checkpointing for layer in copy.model.layers]

    assert flags("hf-every:2") == [True, False, True, False]
    assert flags("hf-every:3") == [True, False, False, True]
    assert flags("hf-every:1") == flags("checkpoint") == [True] * 4  # HF's own, every layer
    for name in ("hf-every:2", "checkpoint"):
        runner.step(name)
        runner.step(name)
    assert not library.is_activation_checkpointing, "the shared model checkpoints"
    assert len(embeddings._forward_hooks) == hooks, "a hook was left on the shared model"
    copy = bench.hf_model(runner.model_for("hf-every:2").model)
    assert len(copy.get_input_embeddings()._forward_hooks) == hooks + 1  # turned on once


def test_checkpoint_of_an_hf_script_needs_no_blocks(script: Path) -> None:
    workload = bench.script_workload(f"{script}:without_blocks", seed=0)
    assert workload.checkpointing is not None and workload.library_model is not None
    assert not bench.needs_blocks("checkpoint", workload)
    assert bench.needs_blocks("recompute", workload)
    assert "recompute" not in bench.resolve_policies(
        [n for n in bench.default_policies(workload) if not bench.needs_blocks(n, workload)]
    )


def test_hf_offload_runs_hf_s_code_with_equal_grads_where_it_can_pin(
    script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU HF's offload cannot pin (rule 5 of the NOTE): with a ``save_on_cpu`` that
    does not pin in its place, HF's own code runs, and its gradients are plain autograd's."""
    from transformers import modeling_utils

    calls: list[bool] = []

    def unpinned(pin_memory: bool = False, device_type: str = "cuda") -> Any:
        calls.append(pin_memory)
        return torch.autograd.graph.save_on_cpu(pin_memory=False, device_type=device_type)

    monkeypatch.setattr(modeling_utils, "save_on_cpu", unpinned)
    cuda = torch.device("cuda")
    monkeypatch.setattr(
        variants, "hf_skip_reason", lambda name, model, device: hf.hf_skip_reason(name, model, cuda)
    )
    workload = bench.script_workload(f"{script}:make", seed=0)
    found = bench.run_bench(policies=["hf-offload"], steps=1, warmup=0, workload=workload)
    assert [row.policy for row in found] == ["none", "hf-offload"]
    assert found[1].skipped is None and found[1].grads_equal is True
    assert calls and all(calls), "HF's offload did not run"


def test_hf_peers_on_a_model_without_hf_are_skipped_not_run() -> None:
    found = bench.run_bench("tiny", ["hf-every:2", "hf-offload", "lz4"], steps=1, warmup=0)
    rows = {row.policy: row for row in found}
    for name in ("hf-every:2", "hf-offload"):
        assert rows[name].skipped is not None and "needs a Hugging Face model" in rows[name].skipped
    assert rows["lz4"].grads_equal is True
    table = bench.format_table(found)
    assert "hf-every:2  skipped: needs a Hugging Face model" in table
    assert (
        bench.planned_steps(["hf-every:2"], 1, 0, workload=bench.builtin_workload("tiny", 0)) == 3
    )


def test_hf_peer_that_raises_is_a_failed_row(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str, model: Any) -> Any:
        raise RuntimeError("HF could not turn it on")

    monkeypatch.setattr(variants, "hf_peer_on", broken)
    workload = bench.script_workload(f"{script}:make", seed=0)
    found = bench.run_bench(policies=["hf-every:2", "disk"], steps=1, warmup=0, workload=workload)
    rows = {row.policy: row for row in found}
    assert rows["hf-every:2"].skipped == "failed: RuntimeError: HF could not turn it on"
    assert rows["disk"].grads_equal is True


@pytest.mark.parametrize("name", ["hf-every:0", "hf-every:x", "hf-every:", "hf-offload:2"])
def test_bad_hf_peer_names_are_usage_errors(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="hf-every:<k>"):
        bench.resolve_policies([name])
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "tiny", "--policies", name])
    assert exit_info.value.code == 2
    assert "hf-every:<k>" in capsys.readouterr().err


def test_hf_peer_skipped_where_transformers_lacks_its_argument(script: Path) -> None:
    model = bench.script_workload(f"{script}:make", seed=0).model
    library = bench.hf_model(model)
    cpu = torch.device("cpu")
    assert hf.hf_skip_reason("hf-every:2", model, cpu) is None

    def older(activation_checkpointing_kwargs: Any = None) -> None:  # no every_n_layers
        raise AssertionError("a skipped peer is never turned on")

    library.activation_checkpointing_enable = older
    reason = hf.hf_skip_reason("hf-every:2", model, cpu)
    assert reason is not None and "activation_checkpointing_enable(every_n_layers=...)" in reason
    assert "pip install -U transformers" in reason


def test_default_policies_add_the_hf_peers_on_an_hf_model(script: Path) -> None:
    workload = bench.script_workload(f"{script}:make", seed=0)
    for sweep in (False, True):
        names = bench.default_policies(workload, sweep=sweep)
        assert names[-2:] == list(bench.HF_PEERS)
    tiny = bench.builtin_workload("tiny", seed=0)
    assert bench.default_policies(tiny) == list(bench.DEFAULT_POLICIES)
    assert bench.default_policies(tiny, sweep=True) == list(bench.SWEEP_POLICIES)


@pytest.mark.slow  # both dtypes; bfloat16 autocast is slow on CPUs without bf16 instructions
def test_sweep_runs_the_hf_peers_in_both_dtypes(script: Path) -> None:
    workload = bench.script_workload(f"{script}:make", seed=0)
    found = bench.run_sweep(steps=1, warmup=0, workload=workload)
    for dtype in ("float32", "bfloat16"):
        rows = {row.policy: row for row in found if row.dtype == dtype}
        assert rows["hf-every:2"].skipped is None and rows["hf-every:2"].grads_equal, dtype
        assert "hf-offload" in rows


@pytest.mark.slow  # the example's model, every row's gradients checked: a few minutes
def test_bench_of_the_lora_example_checks_every_row(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    policies = "none,checkpoint,hf-every:2,hf-offload,trl,disk,auto,auto:50%"
    done = subprocess.run(
        [sys.executable, "-m", "tensorstash", "bench", "--model-script",
         f"{EXAMPLES / 'lora_model.py'}:make", "--policies", policies, "--steps", "1",
         "--warmup", "1", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {row["policy"]: row for row in json.loads(out.read_text())}
    assert list(rows) == policies.split(",")
    ran = [row for row in rows.values() if row["skipped"] is None]
    assert {row["policy"] for row in ran} >= {"none", "checkpoint", "hf-every:2", "disk", "auto"}
    assert all(row["grads_equal"] is True for row in ran)
    assert "150,528 trained" in done.stdout


@pytest.mark.slow  # a fresh process per variant
def test_loop_trains_hf_peers_and_skips_those_that_cannot_run(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "loop.json"
    argv = ["bench", "--model-script", f"{script}:make", "--loop", "7", "--steps", "1"]
    argv += ["--policies", "hf-every:2,hf-offload", "--threads", "1", "--json", str(out)]
    assert main(argv) == 0
    rows = {row["policy"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["none", "hf-every:2"]
    assert rows["hf-every:2"]["steady_bytes"] > 0
    assert "skipping hf-offload: HF's offload copies" in capsys.readouterr().err
