"""Incremental detokenization with stop strings.

Text is decoded from a short window of tokens (the standard prefix/read offsets), so each new
token costs O(window), and a multi-byte character split across tokens is held back until it is
whole. Stop strings: the text up to a stop string is kept and the request ends with "stop";
while streaming, the last len(longest stop) - 1 characters are held back so a stop string is
never half-sent.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(
        self, tokenizer, prompt_ids: list[int], stop: list[str], keep_special: tuple[str, ...] = ()
    ) -> None:
        """keep_special: special-token strings kept in the text (a tool-call format's markers);
        every other special token is left out, as usual."""
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.keep = keep_special
        self.drop = [t for t in getattr(tokenizer, "all_special_tokens", []) if t not in keep_special]
        self.prompt_ids = list(prompt_ids)
        self.ids: list[int] = list(prompt_ids[-6:])  # context for the first tokens' spacing
        self.base = len(self.ids)  # ids[base:] are the generated tokens
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""  # the generated text so far (stop strings removed)
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        if not self.keep:
            return self.tok.decode(ids, skip_special_tokens=True)
        text = self.tok.decode(ids, skip_special_tokens=False)
        for t in self.drop:
            text = text.replace(t, "")
        return text

    def add(self, token_ids: list[int]) -> None:
        """Append tokens; sets `stopped` when a stop string appears (text is cut before it)."""
        for t in token_ids:
            if self.stopped:
                return
            self.ids.append(t)
            old = self._decode(self.ids[self.prefix : self.read])
            new = self._decode(self.ids[self.prefix :])
            if len(new) > len(old) and not new.endswith("\ufffd"):
                start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
                self.text += new[len(old) :]
                self.prefix, self.read = self.read, len(self.ids)
                for s in self.stop:
                    at = self.text.find(s, start)
                    if at >= 0:
                        self.text, self.stopped = self.text[:at], True
                        break

    def take(self, final: bool) -> str:
        """New text that is safe to send (everything when final)."""
        hold = 0 if final or self.stopped else max((len(s) for s in self.stop), default=1) - 1
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent : end], end
        return out
