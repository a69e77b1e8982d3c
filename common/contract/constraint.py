"""What a constrained output must match (structured output): a JSON schema, any JSON object, a regex,
a Lark grammar, or one of a few strings. Declared and size-checked here; compiled by the scheduler
(scheduler_service/constraints/), which alone imports the grammar library."""
from __future__ import annotations

import json
from dataclasses import dataclass

from common.contract.quoting import quote

MAX_CONSTRAINT_BYTES = 64 * 1024
MAX_CHOICES = 256
KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class Constraint:
    """kind: one of KINDS; value: the schema, regex or grammar text ("" for json_object), or the
    choices (a tuple of strings) for choice. Invalid values raise ValueError naming the field."""

    kind: str
    value: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint: must be one of {', '.join(KINDS)}, got {quote(self.kind)}")
        if self.kind == "choice":
            self._check_choices()
        elif self.kind != "json_object":
            self._check_text()

    def _check_text(self) -> None:
        field = f"constraint.{self.kind}"
        if not isinstance(self.value, str) or not self.value:
            raise ValueError(f"{field}: must not be empty")
        num_bytes = len(self.value.encode())
        if num_bytes > MAX_CONSTRAINT_BYTES:
            raise ValueError(f"{field}: at most {MAX_CONSTRAINT_BYTES} bytes, got {num_bytes}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as exc:
                raise ValueError(f"{field}: not valid JSON ({exc})") from None
            if not isinstance(schema, dict | bool):
                raise ValueError(f"{field}: must be a JSON object (a schema), got {type(schema).__name__}")

    def _check_choices(self) -> None:
        choices = self.value
        if isinstance(choices, list):
            choices = tuple(choices)
            object.__setattr__(self, "value", choices)
        if not isinstance(choices, tuple) or not choices:
            raise ValueError("constraint.choice.choices: must list at least one string")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"constraint.choice.choices: at most {MAX_CHOICES}, got {len(choices)}")
        if not all(isinstance(c, str) and c for c in choices):
            raise ValueError("constraint.choice.choices: each must be a non-empty string")
        num_bytes = sum(len(c.encode()) for c in choices)
        if num_bytes > MAX_CONSTRAINT_BYTES:
            raise ValueError(f"constraint.choice.choices: at most {MAX_CONSTRAINT_BYTES} bytes in all, got {num_bytes}")
