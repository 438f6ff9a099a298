"""The base class of every config section: strict (unknown keys are errors) and validated on assignment."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

class Strict(BaseModel):
    """Base for config sections: unknown keys are errors (typos must not pass silently)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
