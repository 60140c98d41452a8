"""The CLI's JSON contract (docs/cli-schema.json), for every test that reads ``--json``."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA = Path(__file__).resolve().parents[1] / "docs" / "cli-schema.json"


@functools.cache
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def checked(payload: Any, command: str | None = None) -> Any:
    """``payload`` after checking it against the schema (and its ``command``)."""
    errors = sorted(validator().iter_errors(payload), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message[:300]}" for e in errors[:5])
    if command is not None:
        assert payload["command"] == command
    return payload
