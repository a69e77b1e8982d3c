"""A worker's sequence state has one owner: only runtime/sequence_state.py (WorkerSequence's own
methods) assigns a WorkerSequence's fields or changes its lists.

Checked on the AST of every worker_service module, by field name: an assignment to `<x>.<field>`
or a list method called on `<x>.<field>`, where x is not rooted at self."""
from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from worker_service.runtime.sequence_state import WorkerSequence  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[2] / "worker_service"
OWNER = "runtime/sequence_state.py"
FIELDS = {field.name for field in dataclasses.fields(WorkerSequence)}
LIST_METHODS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}


def _rooted_at_self(node: ast.expr) -> bool:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def _written(targets: list[ast.expr]) -> Iterator[ast.expr]:
    """The expressions an assignment writes: a, b = ... writes both; x.f[i] = ... writes x.f."""
    for target in targets:
        if isinstance(target, ast.Tuple | ast.List):
            yield from _written(target.elts)
        elif isinstance(target, ast.Starred):
            yield from _written([target.value])
        else:
            yield target.value if isinstance(target, ast.Subscript) else target


def field_writes(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for part in _written(targets):
                if isinstance(part, ast.Attribute) and part.attr in FIELDS and not _rooted_at_self(part):
                    yield node.lineno, part.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in LIST_METHODS and isinstance(node.func.value, ast.Attribute)
              and node.func.value.attr in FIELDS and not _rooted_at_self(node.func.value)):
            yield node.lineno, node.func.value.attr


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
