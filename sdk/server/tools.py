"""Tool calls in generated text, parsed into OpenAI `tool_calls`: one parser a model format,
named by the family's spec (`tool_parser`) or `--tool-call-parser`.

  hermes   <tool_call>{"name": N, "arguments": {...}}</tool_call>            (Qwen, Hermes)
  glm45    <tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>   (GLM-4.5+)
  kimi_k2  <|tool_calls_section_begin|><|tool_call_begin|>functions.N:i
           <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>

Text before the first call is the message content. `ToolStream` does the same on streamed text:
content is passed on until a call may begin (a possible partial marker is held back), then each
call is emitted once it is complete.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from dayzero.kernels.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        out = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index} | out


class ToolParser:
    """A format: `start` opens the calls; `calls(text)` -> (complete calls, where the text after
    the last complete call begins)."""

    name = ""
    start = ""
    markers: tuple[str, ...] = ()  # special-token strings the format needs kept in the text

    def calls(self, text: str) -> tuple[list[ToolCall], int]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole answer; text that fails to parse stays content."""
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls, _ = self.calls(text[at:])
        return (text[:at], calls) if calls else (text, [])


def _arguments(value) -> str | None:
    """A JSON object string from a parsed `arguments` (a mapping, or a string holding one)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


class Hermes(ToolParser):
    name, start = "hermes", "<tool_call>"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def calls(self, text: str) -> tuple[list[ToolCall], int]:
        out, end = [], 0
        for m in self._call.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except json.JSONDecodeError:
                break
            args = (
                _arguments(obj.get("arguments", obj.get("parameters", {}))) if isinstance(obj, dict) else None
            )
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or args is None:
                break
            out.append(ToolCall(obj["name"], args))
            end = m.end()
        return out, end


class Glm45(ToolParser):
    name, start = "glm45", "<tool_call>"
    _call = re.compile(r"<tool_call>\s*([^\n<]+?)\s*(?:\n|(?=<arg_key>))(.*?)</tool_call>", re.DOTALL)
    _arg = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def calls(self, text: str) -> tuple[list[ToolCall], int]:
        out, end = [], 0
        for m in self._call.finditer(text):
            args = {}
            for k, v in self._arg.findall(m.group(2)):
                try:
                    args[k.strip()] = json.loads(v)
                except json.JSONDecodeError:
                    args[k.strip()] = v
            out.append(ToolCall(m.group(1).strip(), json.dumps(args, ensure_ascii=False)))
            end = m.end()
        return out, end


class KimiK2(ToolParser):
    name, start = "kimi_k2", "<|tool_calls_section_begin|>"
    markers = (
        "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    )  # fmt: skip
    _call = re.compile(
        r"<\|tool_call_begin\|>\s*([\w.\-]+?)(?::(\d+))?\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
        re.DOTALL,
    )

    def calls(self, text: str) -> tuple[list[ToolCall], int]:
        out, end = [], 0
        for m in self._call.finditer(text):
            args = _arguments(m.group(3).strip())
            if args is None:
                break
            ident = m.group(1)
            name = ident.split(".", 1)[1] if ident.startswith("functions.") else ident
            out.append(ToolCall(name, args, id=f"{ident}:{m.group(2) or len(out)}"))
            end = m.end()
        return out, end


TOOL_PARSERS: Registry[ToolParser] = Registry("tool-call parser")
for _p in (Hermes(), Glm45(), KimiK2()):
    TOOL_PARSERS.add(_p.name, _p)


class ToolStream:
    """Streamed text -> (content to send now, calls completed now)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.buf = ""  # text not yet sent as content, nor consumed by an emitted call
        self.in_calls = False
        self.emitted = 0  # calls sent so far

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.buf += text
        content = ""
        if not self.in_calls:
            at = self.buf.find(self.parser.start)
            if at >= 0:
                content, self.buf, self.in_calls = self.buf[:at], self.buf[at:], True
            else:
                hold = 0 if final else _partial_suffix(self.buf, self.parser.start)
                content, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold :]
                return content, []
        calls, end = self.parser.calls(self.buf)
        if calls:
            self.buf = self.buf[end:]
            self.emitted += len(calls)
        if final and self.buf.strip() and not self.emitted:  # never a call after all: it was content
            content, self.buf = content + self.buf, ""
        return content, calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
