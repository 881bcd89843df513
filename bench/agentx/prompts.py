"""Prompt synthesis: token-exact, cache-structure-exact filler for a trace's block ids.

Position j*64 .. j*64+63 of a turn's prompt holds the 64 filler tokens of block `hash_ids[j]`, a pure function
of (run salt, trace id, block id); the prompt is cut to exactly `in` tokens. Two turns (or a parent and its subagent)
that share leading block ids therefore share exactly those leading tokens, and nothing else is shared: the
server's prefix cache sees the recorded structure. A turn's trailing partial block shows the first tokens of
the block that later fills that position (in the capture its id changes as it fills), so the history a turn
resends is byte-identical to what the previous turn sent.

Cache-bust (AgentX `first_turn_prefix`): every session-tree instance draws a marker `[rid:<12 hex>]\\n\\n`
that overwrites the first tokens of every conversation's first user message (right after the block-aligned
system message; at 0 when there is none), so concurrent or recycled replays of one trace never share a cache
beyond the system prompt, while a tree's own turns still do. Overwriting (not inserting) keeps `in` exact.

Filler tokens are printable ASCII (32..126): with a byte-level tokenizer the same ids are the chat client's
text, so the token-id and chat clients send the same content (the chat template adds its markup). Chat
messages: the system message is the system region; the rest is split at the recorded boundaries of the
earlier turns the prompt extends (user up to `in_j`, assistant = the recorded output `in_j .. in_j+out_j`),
the last segment being the new user (tool result) message.
"""

from __future__ import annotations

import zlib

import numpy as np

from bench.agentx.traces import Conv, Turn

PRINTABLE = (32, 127)


def marker_text(rng: np.random.Generator) -> str:
    return f"[rid:{rng.integers(0, 2 ** 48):012x}]\n\n"


class ByteText:
    """Token ids <-> text for a byte-level tokenizer (the server's `byte` tokenizer)."""

    @staticmethod
    def decode(ids) -> str:
        return bytes(int(i) for i in ids).decode("latin-1")

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))


class TreePrompts:
    """Prompts of one session-tree instance (one trace replayed in one lane, with its marker)."""

    def __init__(self, trace_id: str, block: int, marker: str, vocab: tuple[int, int] = PRINTABLE, text=ByteText,
                 salt: str = ""):
        self.seed = zlib.crc32(f"{salt}/{trace_id}".encode())  # salt: a replay run shares nothing with another
        self.block = block
        self.text = text
        self.marker = np.asarray(text.encode(marker), np.int32)
        self.lo, self.hi = vocab
        self._blocks: dict = {}

    def _block(self, h) -> np.ndarray:
        b = self._blocks.get(h)
        if b is None:
            key = h if isinstance(h, int) else zlib.crc32(repr(h).encode())
            rng = np.random.default_rng([self.seed, key % (1 << 62)])
            b = self._blocks[h] = rng.integers(self.lo, self.hi, self.block, dtype=np.int32)
        return b

    def _partial_id(self, conv: Conv, turn: Turn):
        """The id whose filler a turn's trailing partial block shows: that of the same block in the first later
        turn of the conversation that has it full (the history must not change when the block fills up)."""
        j = len(turn.hash_ids) - 1
        k = turn.index
        while (conv.turns[k].isl < (j + 1) * self.block and k + 1 < len(conv.turns) and conv.extends[k + 1]
               and len(conv.turns[k + 1].hash_ids) > j):
            k += 1
        return conv.turns[k].hash_ids[j]

    def marker_at(self, conv: Conv, turn: Turn | None = None) -> int:
        """Where a conversation's marker goes: after its system region, or at 0 when its first turn is too short
        for that (one place for every turn, so the resent history never changes)."""
        first = conv.turns[0].isl if conv.turns else 0
        return conv.sys_tokens if first >= conv.sys_tokens + len(self.marker) else 0

    def shared_blocks(self, conv: Conv, turn: Turn | None = None) -> int:
        """Leading blocks before the marker (identical in every instance of the trace)."""
        return self.marker_at(conv) // self.block

    def token_array(self, conv: Conv, turn: Turn) -> np.ndarray:
        n = turn.isl
        parts = [self._block(h) for h in turn.hash_ids]
        if parts and n < len(parts) * self.block and conv.turns[turn.index] is turn:
            parts[-1] = self._block(self._partial_id(conv, turn))
        have = len(parts) * self.block
        j = 0
        while have < n:  # fewer ids than `in` / 64 (real captures can be off by a block): unique filler
            parts.append(self._block(("pad", turn.index, j)))
            have += self.block
            j += 1
        ids = np.concatenate(parts)[:n] if parts else np.zeros(0, np.int32)
        at = self.marker_at(conv)
        k = max(0, min(len(self.marker), n - at))  # a prompt ending inside the marker holds its beginning
        if k:
            ids = ids.copy()
            ids[at:at + k] = self.marker[:k]
        return ids

    def tokens(self, conv: Conv, turn: Turn) -> list[int]:
        return self.token_array(conv, turn).tolist()

    def messages(self, conv: Conv, turn: Turn) -> list[dict]:
        ids = self.token_array(conv, turn)
        n = len(ids)
        cuts: dict[int, str] = {}  # segment end -> role of the segment ending there
        i = turn.index
        while i > 0 and conv.extends[i]:
            prev = conv.turns[i - 1]
            cuts[prev.isl] = "user"
            cuts[min(prev.isl + prev.osl, n)] = "assistant"
            i -= 1
        sys_end = conv.sys_tokens if 0 < conv.sys_tokens < n else 0
        out = [{"role": "system", "content": self.text.decode(ids[:sys_end])}] if sys_end else []
        start = sys_end
        for end in sorted(e for e in cuts if sys_end < e < n):
            out.append({"role": cuts[end], "content": self.text.decode(ids[start:end])})
            start = end
        out.append({"role": "user", "content": self.text.decode(ids[start:n])})
        return out
