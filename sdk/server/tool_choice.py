"""tool_choice "required" and a named function, vLLM's way: a grammar holds the answer to the
calls themselves, written as JSON, which are read back as OpenAI tool_calls, whole or streamed.

  named     the answer is the function's arguments: one JSON value of its parameters schema
  required  the answer is [{"name": N, "parameters": <N's parameters>}, ...]: one or more calls
            (at most one without parallel_tool_calls), each of a tool offered

A tool without parameters takes the empty object. Schemas are held strictly (no properties
beyond those listed), as vLLM's xgrammar backend holds them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dayzero.sdk.server.tools import ToolCall

NO_PARAMETERS = {"type": "object", "properties": {}}
DEFS_KEYS = ("$defs", "definitions")  # where JSON schemas keep what "#/$defs/X" refers to


class ToolsError(ValueError):
    """The tools' schemas cannot be combined into one (the client's error)."""


USAGE = '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True)
class ForcedChoice:
    """What the answer is held to (`schema`) and how it reads as calls."""

    name: str | None  # the named function; None: "required"
    schema: dict

    def reader(self) -> CallReader:
        """A fresh reader of one answer's calls."""
        return NamedCall(self.name) if self.name is not None else CallArray()


def forced_choice(tool_choice, tools: list[dict] | None, parallel: bool = True) -> ForcedChoice | None:
    """The constraint tool_choice asks for (None: "auto", "none" or unset); a ValueError says
    what is wrong with it. tools: the request's, as {"type": "function", "function": {...}}."""
    if tool_choice in (None, "none", "auto"):
        return None
    named = tool_choice != "required"
    if named:
        fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name or tool_choice.get("type") != "function":
            raise ValueError(f"tool_choice must be {USAGE}")
    if not tools:
        raise ValueError("tool_choice 'required' or a named function needs `tools`")
    params = {t["function"]["name"]: t["function"].get("parameters") or NO_PARAMETERS for t in tools}
    if not named:
        return ForcedChoice(None, call_array_schema(params, parallel))
    if name not in params:
        offered = ", ".join(params)
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools ({offered})")
    return ForcedChoice(name, params[name])


def call_array_schema(params: dict[str, dict], parallel: bool) -> dict:
    """[{"name": N, "parameters": ...}, ...] over the tools; each tool's $defs move to the root,
    where their references point."""
    defs: dict[str, dict] = {}
    items = []
    for name, schema in params.items():
        schema = dict(schema)
        for key in DEFS_KEYS:
            for ref, sub in (schema.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(ref, sub) != sub:
                    raise ToolsError(f"tools define {key} {ref!r} differently; give them distinct names")
        items.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
            }
        )
    out = {"type": "array", "items": {"anyOf": items}, "minItems": 1} | defs
    return out | ({} if parallel else {"maxItems": 1})


def compact(arguments: str) -> str:
    """Arguments as one-line JSON (vLLM's whole answers); a cut answer's text as it is."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except json.JSONDecodeError:
        return arguments


class NamedCall:
    """The answer is the named function's arguments: one call, its text the arguments."""

    def __init__(self, name: str) -> None:
        self.call = ToolCall(name, "")
        self.sent = False  # the call's id and name have gone out

    def whole(self, text: str) -> list[ToolCall]:
        return [ToolCall(self.call.name, compact(text), self.call.id)]

    def finish(self, reason: str | None) -> str | None:
        """OpenAI's and vLLM's: a named call ends "stop", not "tool_calls"."""
        return reason

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """OpenAI tool-call deltas: the first with id and name, then arguments as they grow."""
        if not self.sent and (text or final):
            self.sent = True
            return [ToolCall(self.call.name, text, self.call.id).openai(0)]
        return [{"index": 0, "function": {"arguments": text}}] if text else []


@dataclass
class _Element:
    """One {"name": ..., "parameters": ...} of the array, as far as it has been read."""

    key: str = ""  # the key being read (raw JSON), then the one whose value is read (decoded)
    name: str = ""  # raw JSON string of the name
    args: str = ""  # raw text of the parameters value
    part: str = "key"  # "key" | "value"
    call: ToolCall | None = None  # set once the name is complete
    sent: int = -1  # characters of args sent; -1: the call not announced yet


@dataclass
class CallArray:
    """The answer is a JSON array of {"name", "parameters"} objects, read character by character:
    depth counts the open brackets (1: in the array, 2: in an element, more: inside a value)."""

    elements: list[_Element] = field(default_factory=list)
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def finish(self, reason: str | None) -> str | None:
        """OpenAI's and vLLM's: calls that ended are "tool_calls" (a cut answer stays "length")."""
        return "tool_calls" if reason == "stop" else reason

    def whole(self, text: str) -> list[ToolCall]:
        reader = CallArray()
        reader.feed(text, final=True)
        return [ToolCall(e.call.name, compact(e.args), e.call.id) for e in reader.elements if e.call]

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """OpenAI tool-call deltas: each call's id and name once its name is read, then its
        arguments as they grow."""
        for ch in text:
            self._read(ch)
        out = []
        for i, e in enumerate(self.elements):
            if e.call is None:
                continue
            if e.sent < 0:
                out.append(ToolCall(e.call.name, e.args, e.call.id).openai(i))
            elif len(e.args) > e.sent:
                out.append({"index": i, "function": {"arguments": e.args[e.sent :]}})
            e.sent = len(e.args)
        return out

    def _read(self, ch: str) -> None:
        if self.in_string:
            self._keep(ch)
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self._string_ended()
            return
        if ch == '"':
            self.in_string = True
            self._keep(ch)
        elif ch in "[{":
            if self.depth >= 2:
                self._keep(ch)
            self.depth += 1
            if self.depth == 2:
                self.elements.append(_Element())
        elif ch in "]}":
            self.depth -= 1
            if self.depth >= 2:
                self._keep(ch)
        elif self.depth == 2 and ch in ",:":
            e = self.elements[-1]
            e.part = "value" if ch == ":" else "key"
            if ch == ",":
                e.key = ""
        elif not ch.isspace() or self.depth > 2:
            self._keep(ch)

    def _keep(self, ch: str) -> None:
        """ch belongs to the current element's key, name or parameters."""
        if self.depth < 2 or not self.elements:
            return
        e = self.elements[-1]
        if e.part == "key":
            e.key += ch
        elif e.key == "name":
            e.name += ch
        elif e.key == "parameters":
            e.args += ch

    def _string_ended(self) -> None:
        if self.depth != 2 or not self.elements:
            return
        e = self.elements[-1]
        if e.part == "key":
            e.key = _string(e.key)
        elif e.key == "name":
            e.call = ToolCall(_string(e.name), "")


def _string(literal: str) -> str:
    """A JSON string literal's value (its text between the quotes if it does not parse)."""
    try:
        return json.loads(literal)
    except json.JSONDecodeError:
        return literal[1:-1]


CallReader = NamedCall | CallArray
