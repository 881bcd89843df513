"""Budget-aware structured generation: a constrained output closes within `max_tokens`.

A grammar mask alone lets a model wander (a free string filled with newlines) until `max_tokens` cuts the output
mid-structure. Here each budget-aware request keeps a *closing path*: a concrete token sequence that takes its
matcher from the current state to the end of the grammar (the engine finishes a request when its grammar is done,
or on the end-of-sequence token, which ends the path when the grammar needs it).

Invariant: `len(path) <= remaining` (max_tokens minus the tokens generated so far). It holds at the start since a
request whose shortest completion (`CompiledGrammar.min_tokens`) does not fit is refused up front (HTTP 400 /
gRPC INVALID_ARGUMENT), and each step keeps it:

- free zone (slack = remaining - len(path) >= `zone`): the grammar's own mask, at no extra cost;
- closing zone (slack < zone): each grammar token gets the number of tokens a completion needs if it is chosen, and
  only those that fit stay allowed: the path's head needs len(path); a token after which the same path still closes
  the grammar (more free text, checked with `validate_tokens`) needs 1 + len(path) (+1 when the path ends without an
  end-of-sequence token, a conservative bound); any other (structural) token needs 1 + its own closing (a repair of
  the path, searched for SEARCHES_PER_STEP such tokens per step); until searched it stays masked. The path's head is
  always allowed, so the output is complete when the budget runs out. The classification is reused while the grammar
  mask and the path are unchanged (inside a free string they are).
- after a token the path loses its head, or stays if it still closes, or becomes the searched closing of that
  structural token, or is repaired: the shortest detour from the new state that rejoins a suffix of the old path
  (a few states), else searched anew. A repaired path is an upper bound, not always the shortest.

What is not exact: the free zone checks nothing, so one token could raise the closing length by more than the
zone (it would have to commit, in one token, to a mandatory structure longer than the zone: the zone is
`32 + min_tokens`, more than an extra DSML call or parameter, or an optional schema member, costs in ordinary
grammars); `Budget.overrun` records it. In the closing zone a structural token whose closing was not
searched yet, or not found, is masked although it might fit.

The search (`shortest_closing`): Dijkstra over tokens. A forced run (`compute_ff_tokens`) is one edge. At a
choice node the allowed tokens are grouped by what they lead to (grammar stopped / accepting / the forced tokens
that follow / else the next mask; tokens ending inside a UTF-8 character by the first three only), keeping the
longest token per group; states with one signature at one cost are expanded once. A child with its parent's
signature (more free text) is skipped unless nothing is found without such children (minimum lengths need them);
a token made only of bytes that each lead back to the node's signature is such a child without being tried, and
of the other tokens only the SIGNATURES shortest are tried.
The result is the fewest tokens among these representatives: the true minimum unless two states with one
signature have different shortest futures. JSON is compact (no optional whitespace) and the DSML tool grammar
has fixed separators, so whitespace cannot pad a completion either.
"""

from __future__ import annotations

import heapq

import numpy as np

MAX_NODES = 2000  # search nodes before giving up (a closing path that long is not worth serving)
MIN_ZONE = 32
SIGNATURES = 128  # tokens tried per search state beyond those made of looping bytes (shortest first)
REPAIR_NODES = 32  # states searched to rejoin the old path after a structural token
SEARCHES_PER_STEP = 2  # closings of structural tokens searched per step in the closing zone
STRUCTURAL_NODES = 16  # states per such search


class TokenTable:
    """Per token id: its length, its ASCII bytes (a bitset), whether it has other bytes and whether it ends inside
    a UTF-8 character; and the single-byte tokens."""

    def __init__(self, token_bytes: list[bytes], special: set[int] = frozenset()):
        self.length = np.array([len(b) for b in token_bytes], np.int32)
        self.partial = np.array([_ends_inside_char(b) for b in token_bytes], bool)
        self.ascii = np.zeros((len(token_bytes), 2), np.uint64)  # bit c % 64 of word c // 64: has ASCII byte c
        self.non_ascii = np.array([any(c >= 128 for c in b) for b in token_bytes], bool)
        self.byte_token = np.full(256, -1, np.int64)
        for t, b in enumerate(token_bytes):
            for c in set(b):
                if c < 128:
                    self.ascii[t, c // 64] |= np.uint64(1) << np.uint64(c % 64)
            if len(b) == 1 and t not in special and self.byte_token[b[0]] < 0:
                self.byte_token[b[0]] = t


def _ends_inside_char(b: bytes) -> bool:
    for k in range(1, min(4, len(b)) + 1):
        c = b[-k]
        if c & 0xC0 != 0x80:  # the last byte that is not a continuation byte
            need = 2 if c >> 5 == 0b110 else 3 if c >> 4 == 0b1110 else 4 if c >> 3 == 0b11110 else 1
            return need > k
    return bool(b)  # only continuation bytes: completes a character begun earlier, or not (unknowable)


def _signature(node, t: int, table: TokenTable, row: np.ndarray) -> tuple:
    """What token t leads to: (stopped, accepting, forced tokens[, next mask]); node is unchanged."""
    node.consume_token(t)
    ff = tuple(node.compute_ff_tokens())
    sig = (node.is_stopped(), node.is_accepting(), ff)
    if not ff and not sig[0] and not table.partial[t]:  # what may follow tells the states apart
        node.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        sig += (row.tobytes(),)
    node.rollback(1)
    return sig


def _text_loops(node, table: TokenTable, text: str, itself: tuple, row: np.ndarray) -> bool:
    """Does writing `text` (byte by byte) lead back to a state like `itself`?"""
    ids = [int(table.byte_token[b]) for b in text.encode()]
    if min(ids) < 0 or node.validate_tokens(ids) != len(ids):
        return False
    node.consume_tokens(ids[:-1])
    same = _signature(node, ids[-1], table, row) == itself
    node.rollback(len(ids) - 1)
    return same


def _mask_tokens(m, vocab_size: int, row: np.ndarray) -> np.ndarray:
    m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    return _row_tokens(row, vocab_size)


def _row_tokens(row: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = (row[:, None] >> np.arange(32, dtype=np.uint32)[None, :]) & 1
    return np.flatnonzero(bits.reshape(-1)[:vocab_size])


def closes(m, path: list[int], eos: int | None = None) -> bool:
    """Does `path` take matcher m from its state to the end of the grammar? (m is left unchanged)"""
    if not path:
        return m.is_stopped()
    if m.validate_tokens(path) != len(path):
        return False
    if path[-1] == eos:  # accepted up to the end-of-sequence token: done
        return True
    m.consume_tokens(path)
    ok = m.is_stopped()
    m.rollback(len(path))
    return ok


def shortest_closing(m, vocab_size: int, eos: int | None, table: TokenTable, max_nodes: int = MAX_NODES,
                     reuse: list[int] | None = None) -> list[int] | None:
    """The fewest-token completion from matcher m's state (m is unchanged), or None if none is found (within
    `max_nodes` expanded states). With `reuse` (an earlier
    closing path), a state from which a suffix of it closes the grammar ends the search there: the result is the
    shortest repair that rejoins that path, an upper bound found in a few states."""
    for loops in (False, True):
        path = _search(m, vocab_size, eos, table, loops, max_nodes, reuse)
        if path is not None:
            return path
    return None


def _rejoin(node, path: list[int], eos: int | None) -> list[int] | None:
    """The shortest suffix of `path` that closes the grammar from node's state."""
    for k in range(len(path), -1, -1):
        if closes(node, path[k:], eos):
            return path[k:]
    return None


def _search(m, vocab_size: int, eos: int | None, table: TokenTable, loops: bool, max_nodes: int,
            reuse: list[int] | None):
    row = np.zeros((vocab_size + 31) // 32, np.uint32)
    heap = [(0, 0, m.deep_copy(), ())]
    seen: set[tuple] = set()
    seq, expanded = 1, 0
    while heap:
        cost, _, node, path = heapq.heappop(heap)
        if node is None or node.is_stopped():
            return list(path)
        expanded += 1
        if expanded > max_nodes:
            return None
        if reuse:
            tail = _rejoin(node, reuse, eos)
            if tail is not None:
                heapq.heappush(heap, (cost + len(tail), seq, None, path + tuple(tail)))
                seq += 1
                continue
        if node.is_accepting() and eos is not None:
            heapq.heappush(heap, (cost + 1, seq, None, path + (eos,)))
            seq += 1
        ff = node.compute_ff_tokens()
        if ff and node.validate_tokens(ff) == len(ff):
            node.consume_tokens(ff)
            heapq.heappush(heap, (cost + len(ff), seq, node, path + tuple(ff)))
            seq += 1
            continue
        groups: dict[tuple, tuple[int, int]] = {}
        tokens = _mask_tokens(node, vocab_size, row)
        itself = (False, node.is_accepting(), (), row.tobytes())  # a child like this node: more free text
        allowed = set(tokens.tolist())
        loop_bits = np.zeros(2, np.uint64)  # ASCII bytes that lead back to a state like this one
        for byte, t in enumerate(table.byte_token[:128].tolist()):
            if t >= 0 and t in allowed and _signature(node, t, table, row) == itself:
                loop_bits[byte // 64] |= np.uint64(1) << np.uint64(byte % 64)
        # non-ASCII text: one character per UTF-8 length stands for all (grammars rarely tell them apart)
        text_loops = all(_text_loops(node, table, ch, itself, row) for ch in "é中😀")
        looping = ((table.ascii[tokens] & ~loop_bits) == 0).all(axis=1) & (text_loops | ~table.non_ascii[tokens])
        if loops and looping.any():
            rep = tokens[looping][np.argmax(table.length[tokens[looping]])]
            groups[itself] = (int(rep), 0)
        others = tokens[~looping]
        if len(others) > SIGNATURES:  # the shortest tokens carry the structure; long ones are mostly text
            others = others[np.argsort(table.length[others], kind="stable")[:SIGNATURES]]
        for t in others.tolist():
            if t == eos:
                continue
            sig = _signature(node, t, table, row)
            if sig == itself and not loops:
                continue
            n = int(table.length[t])
            if sig not in groups or n > groups[sig][1]:
                groups[sig] = (t, n)
        for sig, (t, _) in groups.items():
            if (sig, cost + 1) in seen:
                continue
            seen.add((sig, cost + 1))
            child = node.deep_copy()
            child.consume_token(t)
            heapq.heappush(heap, (cost + 1, seq, child, path + (t,)))
            seq += 1
    return None


class Budget:
    """One request's closing path and its mask filter (see the module docstring)."""

    def __init__(self, m, remaining: int, min_path: list[int], vocab_size: int, eos: int | None, table: TokenTable,
                 zone: int):
        self.m, self.remaining, self.path = m, remaining, list(min_path)
        self.vocab_size, self.eos, self.table, self.zone = vocab_size, eos, table, zone
        self.overrun = False  # the invariant broke: a free-zone token committed to more than the zone
        self._key: tuple | None = None  # (grammar mask, path) that the classification below belongs to
        self._ids = self._need = None  # the grammar's tokens, and the tokens a completion needs after each
        self._todo: list[int] = []  # indices of structural tokens whose closing is not searched yet
        self._paths: dict[int, list[int]] = {}  # closing paths found after structural tokens

    def filter(self, row: np.ndarray):
        """Narrow the grammar mask in `row` (already written) to the tokens after which a completion fits."""
        if not self.path or self.remaining - len(self.path) >= self.zone:
            return
        if self.remaining <= len(self.path):  # no slack: the path's head is the only token that fits
            row[:] = 0
            row[self.path[0] // 32] = np.uint32(1) << np.uint32(self.path[0] % 32)
            return
        key = (row.tobytes(), tuple(self.path))
        if key != self._key:
            self._classify(row)
            self._key = key
        self._search_some()
        if self._need.max() <= self.remaining:  # every grammar token leaves room to close
            return
        ids = self._ids[self._need <= self.remaining]
        row[:] = 0
        np.bitwise_or.at(row, ids // 32, np.uint32(1) << (ids % 32).astype(np.uint32))

    def _classify(self, row: np.ndarray):
        """Per grammar token: the path's head needs len(path); a token after which the path still closes needs
        1 + that; any other (structural) token is unknown (masked) until its own closing is searched."""
        ids = _row_tokens(row, self.vocab_size)
        need = np.full(len(ids), np.iinfo(np.int64).max, np.int64)
        head, self._paths, self._todo = self.path[0], {}, []
        for i, t in enumerate(ids.tolist()):
            n = len(self.path) - 1 if t == head else closes_after(self.m, t, self.path, self.eos)
            if n is None:
                self._todo.append(i)
            else:
                need[i] = 1 + n
        self._ids, self._need = ids, need

    def _search_some(self):
        """Search the closings of a few structural tokens per step (deterministic: a count, not a clock)."""
        for _ in range(min(SEARCHES_PER_STEP, len(self._todo))):
            i = self._todo.pop()
            t = int(self._ids[i])
            self.m.consume_token(t)
            found = [] if self.m.is_stopped() else shortest_closing(self.m, self.vocab_size, self.eos, self.table,
                                                                     STRUCTURAL_NODES, reuse=self.path)
            self.m.rollback(1)
            if found is not None:
                self._paths[t] = found
                self._need[i] = 1 + len(found)

    def advance(self, token: int):
        """The matcher consumed `token`: update the remaining budget and the closing path."""
        self.remaining -= 1
        if self.path and token == self.path[0]:
            self.path = self.path[1:]
        elif token in self._paths and closes(self.m, self._paths[token], self.eos):
            self.path = self._paths[token]
        elif not closes(self.m, self.path, self.eos):  # a structural token: rejoin the old path, else search anew
            self.path = (shortest_closing(self.m, self.vocab_size, self.eos, self.table, REPAIR_NODES,
                                          reuse=self.path)
                         or shortest_closing(self.m, self.vocab_size, self.eos, self.table) or [])
        if len(self.path) > self.remaining:
            self.overrun = True


def closes_after(m, token: int, path: list[int], eos: int | None) -> int | None:
    """How many tokens, at most, close the grammar after `token` by reusing `path` (None: `path` does not fit
    there). Checked with `validate_tokens` only: the matcher is unchanged."""
    if path and path[-1] == eos:
        return len(path) if m.validate_tokens([token] + path) == len(path) + 1 else None
    if eos is not None:
        return len(path) + 1 if m.validate_tokens([token] + path + [eos]) == len(path) + 2 else None
    if m.validate_tokens([token]) != 1:
        return None
    m.consume_token(token)
    ok = m.is_stopped() or closes(m, path)
    m.rollback(1)
    return len(path) if ok else None
