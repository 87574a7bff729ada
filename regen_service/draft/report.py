"""What validation found in a draft directory: a `DraftReport` of `Problem`s (code, file, key, message, fix).

The type every check writes into (validate.py, validate_config.py, validate_tensors.py) and every caller
reads (export, convert, the launch preflights, `regen validate-draft`); it holds no check itself and
imports pydantic only, so the checks import it and never each other's entry point.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Problem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str
    message: str
    fix: str
    severity: Literal["error", "warning"] = "error"
    file: str = ""  # the file to edit (config.json, model.safetensors), when one is to blame
    key: str = ""  # the config field or tensor name


class DraftReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    problems: list[Problem] = Field(default_factory=list)
    summary: dict = Field(default_factory=dict)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def add(
        self, code: str, message: str, fix: str, severity: str = "error", *, file: str = "", key: str = ""
    ) -> None:
        self.problems.append(
            Problem(code=code, message=message, fix=fix, severity=severity, file=file, key=key)
        )
