"""Sequence state has owners: only sequence.py (its transitions) assigns a Sequence's fields, and
only the block manager changes its block table and block hashes.

Checked on the AST of every scheduler_service module that imports Sequence (or ScheduledSequence),
by field name (tests/ownership_checks.py); the detokenizer and StepRequest likewise, below."""
from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.core.block_manager import Block
from scheduler_service.core.sequence import Sequence
from tests.ownership_checks import LIST_METHODS, field_writes, written

PACKAGE = Path(__file__).resolve().parents[2] / "scheduler_service"
FIELDS = {field.name for field in dataclasses.fields(Sequence)}
# A Block has a token_ids of its own (a tuple, only ever reassigned): assignments to it are the
# block manager's business. A Sequence's token_ids is a list that only grows, caught as a call.
ASSIGNED_FIELDS = FIELDS - {field.name for field in dataclasses.fields(Block)}
OWNERS = {"core/sequence.py": FIELDS, "core/block_manager.py": {"block_table", "block_hashes"}}


def _imports_sequence(tree: ast.AST) -> bool:
    return any(isinstance(node, ast.ImportFrom) and (node.module or "").startswith("scheduler_service.")
               and {alias.name for alias in node.names} & {"Sequence", "ScheduledSequence"}
               for node in ast.walk(tree))


def _field_writes(tree: ast.AST) -> Iterator[tuple[int, str]]:
    return field_writes(tree, ASSIGNED_FIELDS, FIELDS)


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


# The detokenizer has one owner: the engine core creates, advances, drains and finishes it (it
# rides on its Sequence, declared in sequence.py; the class lives in detokenizer.py; the engine
# core's stop check, in stop_conditions.py, advances it token by token).
DETOKENIZER_OWNERS = {"core/engine_core.py", "core/sequence.py", "core/detokenizer.py", "core/stop_conditions.py"}
SERVICE_ROOTS = {"scheduler_service": PACKAGE, "offline": PACKAGE.parent / "offline",
                 "launch": PACKAGE.parent / "launch"}
# A StepRequest is built by the step builder; the worker client stamps its session on it, nothing else.
STEP_REQUEST_FIELDS = set(worker_pb2.StepRequest.DESCRIPTOR.fields_by_name)
STEP_REQUEST_OWNERS = {"core/step_builder.py": STEP_REQUEST_FIELDS | {"StepRequest(...)"},
                       "lanes/worker_client.py": {"session_id"}}


def _modules() -> Iterator[tuple[str, ast.AST]]:
    for root_name, root in SERVICE_ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            name = path.relative_to(root).as_posix() if root_name == "scheduler_service" else f"{root_name}/{path.name}"
            yield name, ast.parse(path.read_text(), str(path))


def _detokenizer_uses(tree: ast.AST) -> Iterator[int]:
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "detokenizer") or \
                (isinstance(node, ast.Name) and node.id == "IncrementalDetokenizer"):
            yield node.lineno


def _is_step_request_type(node: ast.expr | None) -> bool:
    return node is not None and "StepRequest" in ast.unparse(node)


def _step_request_names(tree: ast.AST) -> set[str]:
    """Names a module binds to a StepRequest: parameters annotated so, variables assigned one."""
    names = {node.arg for node in ast.walk(tree)
             if isinstance(node, ast.arg) and _is_step_request_type(node.annotation)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _is_step_request_type(node.value.func):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return names


def _step_request_writes(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Constructions, and writes to a field of a StepRequest: one bound to a name as above, or an
    InFlightStep's `.request`."""
    names = _step_request_names(tree)

    def is_request(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id in names) or (isinstance(node, ast.Attribute)
                                                                      and node.attr == "request")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_step_request_type(node.func):
            yield node.lineno, "StepRequest(...)"
        elif isinstance(node, ast.Assign | ast.AugAssign):
            for part in written(node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(part, ast.Attribute) and part.attr in STEP_REQUEST_FIELDS and is_request(part.value):
                    yield node.lineno, part.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in LIST_METHODS | {"add", "MergeFrom", "CopyFrom"}
              and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in STEP_REQUEST_FIELDS
              and is_request(node.func.value.value)):
            yield node.lineno, node.func.value.attr


def test_only_the_engine_core_touches_the_detokenizer() -> None:
    violations = [f"{name}:{line} touches the detokenizer" for name, tree in _modules()
                  if name not in DETOKENIZER_OWNERS for line in _detokenizer_uses(tree)]
    assert violations == []
    assert list(_detokenizer_uses(ast.parse("seq.detokenizer.finish()")))  # the check sees a use


def test_only_the_step_builder_builds_step_requests() -> None:
    violations = [f"{name}:{line} writes StepRequest.{what}" for name, tree in _modules()
                  for line, what in _step_request_writes(tree)
                  if what not in STEP_REQUEST_OWNERS.get(name, set())]
    assert violations == []
    source = "def f(r: worker_pb2.StepRequest, step):\n  r.running_sequences.add(seq_id=1)\n  step.request.step_id = 2"
    assert sorted(what for _, what in _step_request_writes(ast.parse(source))) == ["running_sequences", "step_id"]
