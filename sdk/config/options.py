"""The value types of spec fields, shared by the spec schema and every block's option schema.

A number or flag in a spec is a literal or a `$symbol` reference (read from the HF config when
the spec is resolved); `Strict` models refuse unknown fields and are immutable.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, StringConstraints

Ref = Annotated[str, StringConstraints(pattern=r"^\$[A-Za-z_][A-Za-z0-9_]*$")]
IntV = int | Ref
FloatV = float | Ref
BoolV = bool | Ref
Expr = Annotated[str, StringConstraints(min_length=1)]
Formula = Annotated[str, StringConstraints(pattern=r"^=.+")]  # an `= expression` over symbols


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
