"""dayzero: Day-0 serving of new LLM architectures. The offline API:

    from dayzero import LLM, SamplingParams

    llm = LLM()  # no model: the embedded SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    print(out[0].outputs[0].text)

pyproject.toml installs this folder as the package `dayzero` (its parts: `dayzero.sdk`,
`dayzero.kernels`, `dayzero.models`). The names load on first use, so importing a part (the CLI,
the kernels) does not import the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dayzero.sdk.api import LLM
    from dayzero.sdk.engine.sampling import SamplingParams

EXPORTS = {"LLM": "dayzero.sdk.api", "SamplingParams": "dayzero.sdk.engine.sampling"}  # name -> module
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> object:
    if name not in EXPORTS:
        raise AttributeError(f"module 'dayzero' has no attribute {name!r}")
    value = getattr(importlib.import_module(EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
