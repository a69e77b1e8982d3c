"""A worker's sequence state has one owner: only runtime/sequence_state.py (WorkerSequence's own
methods) assigns a WorkerSequence's fields or changes its lists.

Checked on the AST of every worker_service module, by field name (tests/ownership_checks.py)."""
from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests import ownership_checks  # noqa: E402
from worker_service.runtime.sequence_state import WorkerSequence  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[2] / "worker_service"
OWNER = "runtime/sequence_state.py"
FIELDS = {field.name for field in dataclasses.fields(WorkerSequence)}


def field_writes(tree: ast.AST) -> Iterator[tuple[int, str]]:
    return ownership_checks.field_writes(tree, FIELDS, FIELDS)


def test_only_sequence_state_changes_worker_sequence_fields() -> None:
    checked, violations = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        checked.append(name)
        if name != OWNER:
            violations += [f"{name}:{line} changes WorkerSequence.{field}"
                           for line, field in field_writes(ast.parse(path.read_text(), str(path)))]
    assert {"runtime/worker.py", "runtime/batch.py", "runtime/model_runner.py"} <= set(checked)
    assert violations == []


def test_the_check_sees_a_write() -> None:
    source = "def f(state, chunk):\n    chunk.state.num_tokens += 1\n    state.token_ids.extend([1])\n"
    assert list(field_writes(ast.parse(source))) == [(2, "num_tokens"), (3, "token_ids")]
