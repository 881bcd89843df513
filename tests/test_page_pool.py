"""Property tests of the page pool and prefix cache."""
import hashlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from serving.engine.block_hash import block_hashes
from serving.engine.page_pool import PagePool


def h(i):
    return hashlib.sha256(str(i).encode()).digest()


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = PagePool(12, session_ttl=5.0)
        self.owners: dict[int, list[int]] = {}  # request -> pages it holds (one reference each)
        self.next = 0
        self.now = 0.0

    @rule(n=st.integers(1, 5))
    def allocate(self, n):
        free_before = self.pool.num_free()
        held = {p for ps in self.owners.values() for p in ps}
        got = self.pool.allocate(n, self.now)
        if got is None:
            assert n > free_before
            return
        assert len(got) == n and len(set(got)) == n and 0 not in got
        assert not (set(got) & held), "eviction took a referenced page"
        self.owners[self.next] = got
        self.next += 1

    @precondition(lambda self: self.owners)
    @rule(data=st.data(), session=st.booleans())
    def release(self, data, session):
        rid = data.draw(st.sampled_from(sorted(self.owners)))
        self.pool.release(self.owners.pop(rid), "s" if session else None, self.now)

    @precondition(lambda self: self.owners)
    @rule(data=st.data(), key=st.integers(0, 6))
    def register(self, data, key):
        rid = data.draw(st.sampled_from(sorted(self.owners)))
        pages = self.owners[rid]
        self.pool.register(pages[data.draw(st.integers(0, len(pages) - 1))], h(key))

    @rule(keys=st.lists(st.integers(0, 6), max_size=4))
    def hit(self, keys):
        pages = self.pool.lookup([h(k) for k in keys])
        assert len(pages) <= len(keys)
        for p, k in zip(pages, keys):
            assert self.pool.hash_of[p] == h(k)
        if pages:
            self.pool.acquire(pages)
            self.owners[self.next] = pages
            self.next += 1

    @rule(dt=st.floats(0, 3))
    def tick(self, dt):
        self.now += dt

    @invariant()
    def consistent(self):
        self.pool.check()
        refs = {}
        for ps in self.owners.values():
            for p in ps:
                refs[p] = refs.get(p, 0) + 1
        for p in range(1, self.pool.num_pages):
            assert self.pool.ref[p] == refs.get(p, 0)

    def teardown(self):
        for rid in list(self.owners):
            self.pool.release(self.owners.pop(rid), None, self.now)
        self.pool.check()
        assert self.pool.num_free() == self.pool.num_pages - 1  # every page free or cached


TestPool = PoolMachine.TestCase
TestPool.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_eviction_order_and_session_retention():
    pool = PagePool(7, session_ttl=10.0)
    a = pool.allocate(3, 0.0)  # a session's prefix
    b = pool.allocate(3, 0.0)  # an anonymous request
    for i, p in enumerate(a):
        pool.register(p, h(("a", i)))
    for i, p in enumerate(b):
        pool.register(p, h(("b", i)))
    pool.release(a, "sess", now=1.0)
    pool.release(b, None, now=2.0)
    # anonymous cached pages go first, tail first (b[2] released first), before the session's pages
    assert pool.allocate(3, now=3.0) == [b[2], b[1], b[0]]
    assert pool.lookup([h(("a", 0)), h(("a", 1))]) == a[:2]
    # once the TTL has passed, session pages are ordinary LRU victims
    assert pool.allocate(1, now=20.0) == [a[2]]
    pool.check()


def test_block_hashes_chain_and_salt():
    toks = list(range(200))
    hs = block_hashes(toks)
    assert len(hs) == 3
    assert block_hashes(toks[:128]) == hs[:2]
    assert block_hashes(toks, parents=hs[:1]) == hs
    assert block_hashes(toks, "tenant")[0] != hs[0]
    other = toks.copy()
    other[70] += 1
    h2 = block_hashes(other)
    assert h2[0] == hs[0] and h2[1] != hs[1] and h2[2] != hs[2]  # the chain fingerprints the whole prefix
