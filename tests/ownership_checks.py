"""AST checks for the state-ownership tests: which module writes which fields of an object, found by
field name (an assignment to `<x>.<field>`, or a list method called on `<x>.<field>`, where x is not
rooted at self: objects that hold another never reach into it through self)."""
from __future__ import annotations

import ast
from collections.abc import Iterator

LIST_METHODS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}


def rooted_at_self(node: ast.expr) -> bool:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def written(targets: list[ast.expr]) -> Iterator[ast.expr]:
    """The expressions an assignment writes: a, b = ... writes both; x.f[i] = ... writes x.f."""
    for target in targets:
        if isinstance(target, ast.Tuple | ast.List):
            yield from written(target.elts)
        elif isinstance(target, ast.Starred):
            yield from written([target.value])
        else:
            yield target.value if isinstance(target, ast.Subscript) else target


def field_writes(tree: ast.AST, assigned_fields: set[str], list_fields: set[str]) -> Iterator[tuple[int, str]]:
    """(line, field) of every assignment to one of assigned_fields and list change of one of list_fields."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for part in written(targets):
                if isinstance(part, ast.Attribute) and part.attr in assigned_fields and not rooted_at_self(part):
                    yield node.lineno, part.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in LIST_METHODS and isinstance(node.func.value, ast.Attribute)
              and node.func.value.attr in list_fields and not rooted_at_self(node.func.value)):
            yield node.lineno, node.func.value.attr
