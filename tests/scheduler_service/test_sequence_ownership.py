"""Sequence state has owners: only sequence.py (its transitions) assigns a Sequence's fields, and
only the block manager changes its block table and block hashes.

Checked on the AST of every scheduler_service module that imports Sequence (or ScheduledSequence),
by field name: an assignment to `<x>.<field>` or a list method called on `<x>.<field>`, where x is
not rooted at self (objects that hold sequences never reach into them through self here)."""
from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from scheduler_service.core.block_manager import Block
from scheduler_service.core.sequence import Sequence

PACKAGE = Path(__file__).resolve().parents[2] / "scheduler_service"
FIELDS = {field.name for field in dataclasses.fields(Sequence)}
# A Block has a token_ids of its own (a tuple, only ever reassigned): assignments to it are the
# block manager's business. A Sequence's token_ids is a list that only grows, caught as a call.
ASSIGNED_FIELDS = FIELDS - {field.name for field in dataclasses.fields(Block)}
LIST_METHODS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}
OWNERS = {"core/sequence.py": FIELDS, "core/block_manager.py": {"block_table", "block_hashes"}}


def _imports_sequence(tree: ast.AST) -> bool:
    return any(isinstance(node, ast.ImportFrom) and (node.module or "").startswith("scheduler_service.")
               and {alias.name for alias in node.names} & {"Sequence", "ScheduledSequence"}
               for node in ast.walk(tree))


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


def _field_writes(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for part in _written(targets):
                if isinstance(part, ast.Attribute) and part.attr in ASSIGNED_FIELDS and not _rooted_at_self(part):
                    yield node.lineno, part.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in LIST_METHODS and isinstance(node.func.value, ast.Attribute)
              and node.func.value.attr in FIELDS and not _rooted_at_self(node.func.value)):
            yield node.lineno, node.func.value.attr


def test_only_owners_change_sequence_fields() -> None:
    checked, violations = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        if name != "core/sequence.py" and not _imports_sequence(tree):
            continue
        checked.append(name)
        allowed = OWNERS.get(name, set())
        violations += [f"{name}:{line} changes Sequence.{field}" for line, field in _field_writes(tree)
                       if field not in allowed]
    assert {"core/scheduler.py", "core/engine_core.py", "core/step_builder.py", "lanes/worker_lane.py"} <= set(checked)
    assert violations == []
