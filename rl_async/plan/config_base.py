"""The base of every run-file section: unknown keys are rejected with their full key path,
and assignments are validated (a loader override is checked like a file value)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
