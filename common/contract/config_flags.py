"""Command-line flags made from the config dataclasses: their fields' defaults and help are the only ones.

A field's metadata (see `option`) holds its help, and optionally `flag` (the flag's name when it is
not the field's, without dashes), `aliases` (further spellings, as typed), `choices`, and `min` and
`max` (which the config checks); a field with `cli=False` (a secret, or one with a special
conversion) gets no flag.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Collection, Mapping
from typing import Any, get_args, get_type_hints


def option(default: Any = dataclasses.MISSING, help: str = "", **flag: Any) -> Any:
    """A dataclass field with its command-line help and flag settings."""
    return dataclasses.field(default=default, metadata={"help": help, **flag})


def _flag_fields(config_type: type, skip: Collection[str]) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(config_type) if f.metadata.get("cli", True) and f.name not in skip]


def add_flags(parser: argparse.ArgumentParser | Any, config_type: type, *, prefix: str = "",
              skip: Collection[str] = (), names: Mapping[str, str] | None = None,
              helps: Mapping[str, str] | None = None) -> None:
    """Adds a flag per field: --<prefix><flag>, dest <prefix>_<field>; names overrides a field's flag
    here, helps its help (where this side's meaning differs). Booleans take --x / --no-x; a required
    field's flag defaults to None."""
    hints = get_type_hints(config_type)
    for f in _flag_fields(config_type, skip):
        name = (names or {}).get(f.name) or f"--{prefix}{f.metadata.get('flag', f.name.replace('_', '-'))}"
        kind = next((t for t in get_args(hints[f.name]) if t is not type(None)), hints[f.name])
        default = None if f.default is dataclasses.MISSING else f.default
        settings: dict[str, Any] = {"dest": prefix.replace("-", "_") + f.name, "default": default,
                                    "help": (helps or {}).get(f.name) or f.metadata.get("help", "")}
        if f.name in (names or {}):  # the value's name in --help follows the flag's
            settings["metavar"] = name.lstrip("-").replace("-", "_").upper()
        if kind is bool:
            settings["action"] = argparse.BooleanOptionalAction
        else:
            settings.update(type=kind, choices=f.metadata.get("choices"))
        parser.add_argument(name, *f.metadata.get("aliases", ()), **settings)


def config_from(config_type: type, args: argparse.Namespace, *, prefix: str = "", **values: Any) -> Any:
    """The config from the flags that add_flags made (fields without one keep their default); values
    (special conversions, secrets) take precedence. Raises the config's ValueError."""
    dest = prefix.replace("-", "_")
    found = {f.name: getattr(args, dest + f.name) for f in dataclasses.fields(config_type)
             if hasattr(args, dest + f.name)}
    return config_type(**{**found, **values})


def to_argv(config: Any, *, skip: Collection[str] = ()) -> list[str]:
    """The flags (unprefixed) that give config's values back to add_flags' parser."""
    argv: list[str] = []
    for f in _flag_fields(type(config), skip):
        name, value = f.metadata.get("flag", f.name.replace("_", "-")), getattr(config, f.name)
        if isinstance(value, bool):
            argv.append(f"--{name}" if value else f"--no-{name}")
        elif value is not None:
            argv += [f"--{name}", str(value)]
    return argv
