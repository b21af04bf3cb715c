"""The README's Python snippets run as shown, and print what it says they print."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import readme_snippet as _snippet
from checks import readme_snippets as _snippets


class _Loss(torch.nn.Module):
    """A small model whose forward returns a scalar loss, as the snippets' ``model`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)
        )

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.net(batch).square().mean()


def _namespace() -> dict[str, Any]:
    """What the snippets take from the reader's program: a model, a batch, a loader."""
    torch.manual_seed(0)
    batch = torch.randn(512, 64)
    model = _Loss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return {
        "model": model,
        "batch": batch,
        "loader": [batch, batch.flip(0)],
        "optimizer": optimizer,
    }


def test_readme_snippets_are_found() -> None:
    """The snippets below are looked up by their first line: a renamed one fails here."""
    assert len(_snippets()) >= 3


def test_opening_snippet(private_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    namespace = _namespace()
    reference = namespace["model"]
    expected = torch.autograd.grad(reference(namespace["batch"]), list(reference.parameters()))
    exec(_snippet("import tensorstash as ts\n\nwith ts.stash("), namespace)
    assert "disk" in capsys.readouterr().out  # the stats table
    grads = [p.grad for p in reference.parameters()]
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    assert [path for path in private_tmp.rglob("*") if path.is_file()] == []  # spill files gone


def test_profile_snippet(private_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    namespace = _namespace()
    exec("import tensorstash as ts\n" + _snippet("profile = ts.Profile()"), namespace)
    assert namespace["profile"].steps == 2  # two steps measured; the second planned from the first
    assert all(p.grad is not None for p in namespace["model"].parameters())
    table = capsys.readouterr().out  # the plan: the model fits its 12 GiB, nothing moves
    assert table.startswith("limit 12.0 GiB: ") and "nothing to move" in table


def test_decision_log_snippet(private_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The row the README shows is the row the code gives."""
    code = _snippet("from tensorstash.bench import")
    lines = code.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("next("))
    comment = []
    for line in lines[at + 1 :]:
        if not line.startswith("#"):
            break
        comment.append(line.removeprefix("#").strip())
    shown = ast.literal_eval(" ".join(comment))
    namespace: dict[str, Any] = {}
    exec("import tensorstash as ts\n" + "\n".join(lines[:at]), namespace)
    assert eval(lines[at], namespace) == shown
    exec("\n".join(lines[at + 1 :]), namespace)
    table = capsys.readouterr().out
    assert "blocks.0.attn.proj" in table and "disk" in table
