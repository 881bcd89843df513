"""Incremental detokenization with stop strings that never leak.

Each generated token costs O(window) work, not O(output): the detokenizer decodes only the ids since the last
emitted boundary (`prefix_offset`) — the previously emitted tail is decoded again as context and its text
subtracted, as vLLM does, so tokenizers whose decoding depends on the previous token (byte-level BPE,
sentencepiece spaces) give the same text as decoding the whole output at once. A decode that ends in an
incomplete UTF-8 sequence (U+FFFD) emits nothing until the next token completes it.

Stop strings are searched only in the window the new text can complete (the new characters plus the longest
stop string minus one before them). `releasable()` is how much of the text may be streamed: everything except
a tail that could still be the beginning of a stop string, so a stop string is never partly sent.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, skip_ids=(), stop: list[str] | tuple[str, ...] = (),
                 include_stop: bool = False):
        self.tok = tokenizer
        self.skip = frozenset(skip_ids)
        self.stop = tuple(stop)
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.include_stop = include_stop
        self.ids: list[int] = []  # non-special generated ids
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.stopped: str | None = None  # the stop string that matched

    def _decode(self, ids) -> str:
        return self.tok.decode(ids) if ids else ""

    def append(self, token_id: int) -> str:
        """Add one generated id; returns the new text (possibly empty). After a stop string matched, the text
        is cut at it (kept when include_stop) and later ids are ignored."""
        if self.stopped is not None or self.tok is None or token_id in self.skip:
            return ""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        before = len(self.text)
        self.text += delta
        if self.stop:
            lo = max(0, before - self.max_stop + 1)
            hits = [(k, s) for s in self.stop if (k := self.text.find(s, lo)) >= 0]
            if hits:
                k, s = min(hits)
                self.stopped = s
                self.text = self.text[:k + (len(s) if self.include_stop else 0)]
                return self.text[before:] if len(self.text) > before else ""
        return delta

    def flush(self):
        """At the end of a request: append whatever is still held back (an incomplete UTF-8 tail decodes to
        U+FFFD, as decoding the whole output would)."""
        if self.stopped is not None or self.tok is None or self.read_offset >= len(self.ids):
            return
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        if len(full) > len(prefix):
            self.text += full[len(prefix):]

    def releasable(self, finished: bool = False) -> int:
        """Characters of `text` that may be streamed now: all of it once finished or stopped, else all but the
        longest tail that is a proper prefix of a stop string."""
        if finished or self.stopped is not None or not self.stop:
            return len(self.text)
        n = len(self.text)
        for k in range(min(self.max_stop - 1, n), 0, -1):
            tail = self.text[n - k:]
            if any(s.startswith(tail) for s in self.stop):
                return n - k
        return n
