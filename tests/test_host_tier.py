"""The host-memory tier for prefix-cache pages (--kv-offloading-size; serving/engine/host_tier.py): a prefix evicted
from the device pool (by anonymous prompts that fill the whole pool) is restored from host memory with the same
greedy output as a kept one, restored pages count as cached tokens, a host page never serves another cache_salt,
and the LRU bound holds. The engines take the shapes of other test files' engines (the pool size is a program
shape), so their programs are persistent-compilation-cache hits: SMALL_ENGINE_ARGS (bounded replay, the production
formats) and tests/harness.py's EXACT_ENGINE_ARGS (exact mode, f32)."""

import numpy as np
import pytest

from dsv41_jax.kv_cache import PageLayout
from serving.engine import Engine, EngineArgs, SamplingParams
from serving.engine.block_hash import BLOCK, block_hashes
from serving.engine.config import SMALL_ENGINE_ARGS, shared_cache_dir
from serving.engine.host_tier import HostTier
from serving.engine.metrics import Metrics
from serving.engine.page_pool import PagePool
from tests.harness import EXACT_ENGINE_ARGS

pytestmark = pytest.mark.timeout(400)


# ---------------------------------------------------------------------------------------------- the tier alone
class FakeDevice:
    """A numpy pages pool standing in for the runner's (read_pages / write_pages)."""

    def __init__(self, rows, width=16, seed=0):
        self.pages = np.random.default_rng(seed).integers(0, 256, (rows, width)).astype(np.uint8)

    def read(self, rows):
        return self.pages[rows].copy()

    def write(self, rows, data):
        self.pages[rows] = data


def test_lru_bound_and_restore_bookkeeping():
    dev = FakeDevice(8)
    m = Metrics()
    tier = HostTier(3 * 16, 16, dev.read, dev.write, m)
    assert tier.capacity == 3
    want = {b"h%d" % r: dev.pages[r].copy() for r in range(1, 6)}
    tier.evicted([(r, b"h%d" % r) for r in range(1, 6)])
    tier.wait()
    assert tier.num_pages() == 3 and list(tier.entries) == [b"h3", b"h4", b"h5"]  # the oldest two dropped
    assert m.counters["offload_saved_pages"] == 5 and m.counters["offload_dropped_pages"] == 2
    assert not tier.has(b"h1") and not tier.queue_restore(7, b"h1")
    dev.pages[:] = 0  # the device rows are reused: the host keeps its own copies
    assert tier.queue_restore(7, b"h3") and tier.queue_restore(6, b"h4")
    tier.evicted([(6, b"h4")])  # row 6 evicted again before the flush: its restore is cancelled
    tier.evicted([(2, b"h9"), (3, b"h10")])  # two saves drop h5 and h3: the queued restore keeps its bytes
    tier.wait()
    assert not tier.has(b"h3")
    tier.flush()
    np.testing.assert_array_equal(dev.pages[7], want[b"h3"])
    assert not dev.pages[6].any() and m.counters["offload_restored_pages"] == 1
    with pytest.raises(ValueError, match="holds no page"):
        HostTier(15, 16, dev.read, dev.write)
    tier.close()


def test_pool_restore_registers_pages_and_salts_stay_apart():
    dev = FakeDevice(6)
    tier = HostTier(10 * 16, 16, dev.read, dev.write)
    pool = PagePool(6)
    pool.attach_tier(tier)
    a = pool.allocate(3)
    for i, p in enumerate(a):
        pool.register(p, b"salt-a/%d" % i)
    pool.release(a)
    saved = {i: dev.pages[p].copy() for i, p in enumerate(a)}
    pool.allocate(5)  # evicts a's pages: saved to the host
    tier.wait()
    assert pool.lookup([b"salt-a/0"]) == [] and pool.restore([b"salt-b/0"]) == []  # other salt: nothing
    pool.release([1, 2, 3, 4, 5])
    got = pool.restore([b"salt-a/0", b"salt-a/1", b"salt-a/2"])
    assert len(got) == 3 and pool.lookup([b"salt-a/%d" % i for i in range(3)]) == got
    pool.check()
    dev.pages[:] = 0
    tier.flush()
    for i, p in enumerate(got):
        np.testing.assert_array_equal(dev.pages[p], saved[i])
    tier.close()


# ---------------------------------------------------------------------------------------------- the engine
def host_tier_size(cfg, args: dict) -> float:
    """--kv-offloading-size (GiB) of twice the device pool: everything evict_all pushes out stays on the host."""
    num_pages = EngineArgs(**args).resolved(cfg).num_pages
    return 2 * num_pages * PageLayout.for_config(cfg).page_bytes / 2 ** 30


@pytest.fixture(scope="module")
def tiered(tiny, tiny_params):
    """The tiny model at the shared test server's shapes (a 65-page device pool) with a host tier of 130 pages."""
    args = EngineArgs(**SMALL_ENGINE_ARGS, compilation_cache_dir=shared_cache_dir(),
                      kv_offloading_size=host_tier_size(tiny, SMALL_ENGINE_ARGS))
    eng = Engine(tiny, args, params=tiny_params, progress=False)
    assert eng.host_tier.capacity == 2 * eng.pool.num_pages
    return eng


def generate(eng, ids, salt=None, n=8):
    rid = f"r{np.random.randint(1 << 30)}"
    eng.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), cache_salt=salt)
    out, cached = [], None
    for o in eng.run_until_done():
        if o.request_id == rid:
            out += o.new_token_ids
            cached = o.num_cached_tokens
    return out, cached


def evict_all(eng, rng):
    for _ in range(eng.pool.num_pages // 3 + 2):  # anonymous prompts of 3 pages, more than the whole pool holds
        generate(eng, rng.integers(0, 256, 3 * BLOCK).tolist(), n=1)
    if eng.host_tier is not None:
        eng.host_tier.wait()


def test_evicted_prefix_is_restored_from_host_memory(tiered):
    W = tiered.cfg.window_size
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, 256, 3 * BLOCK).tolist()
    turn2 = prefix + rng.integers(0, 256, 32).tolist()
    generate(tiered, prefix, n=2)
    kept, cached = generate(tiered, turn2)  # the prefix still on the device
    assert cached == 3 * BLOCK - W
    evict_all(tiered, rng)
    hashes = block_hashes(turn2)[:3]
    assert tiered.pool.lookup(hashes) == [] and all(tiered.host_tier.has(h) for h in hashes)  # host only
    m = tiered.metrics.counters
    restored0 = m["offload_restored_pages"]
    restored, cached = generate(tiered, turn2)
    assert cached == 3 * BLOCK - W  # restored pages count as cached tokens
    assert m["offload_restored_pages"] - restored0 == 3
    assert restored == kept  # identical greedy output to the kept prefix
    assert m["prefix_cache_hits"] > 0 and tiered.host_tier.num_pages() <= tiered.host_tier.capacity
    tiered.pool.check()


def test_host_pages_never_serve_another_salt(tiered):
    rng = np.random.default_rng(6)
    prefix = rng.integers(0, 256, 3 * BLOCK).tolist()
    turn2 = prefix + rng.integers(0, 256, 32).tolist()
    generate(tiered, prefix, salt="tenant-a", n=2)
    evict_all(tiered, rng)
    r0 = tiered.metrics.counters["offload_restored_pages"]
    assert generate(tiered, turn2, salt="tenant-b")[1] == 0
    assert tiered.metrics.counters["offload_restored_pages"] == r0
    assert generate(tiered, turn2, salt="tenant-a")[1] == 3 * BLOCK - tiered.cfg.window_size
    assert tiered.metrics.counters["offload_restored_pages"] == r0 + 3


def test_exact_mode_restored_pages_resume_at_the_device_snapshot(tiny32, tiny32_params):
    """Exact mode: the pages come back from the host, the SWA snapshot never left the device."""
    args = EngineArgs(**EXACT_ENGINE_ARGS, compilation_cache_dir=shared_cache_dir(),
                      kv_offloading_size=host_tier_size(tiny32, EXACT_ENGINE_ARGS))
    eng = Engine(tiny32, args, params=tiny32_params, progress=False)
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, 256, 3 * BLOCK + 8).tolist()  # a snapshot at the last full block (192)
    turn2 = prefix + rng.integers(0, 256, 24).tolist()
    generate(eng, prefix, n=2)
    kept, cached = generate(eng, turn2)
    assert cached == 3 * BLOCK  # exact mode: the whole hit is skipped (resumed at the snapshot)
    evict_all(eng, rng)
    assert eng.pool.lookup(block_hashes(turn2)[:3]) == []
    m = eng.metrics.counters
    before = (m["offload_restored_pages"], m["snapshot_restores"])
    restored, cached = generate(eng, turn2)
    assert cached == 3 * BLOCK and restored == kept
    assert (m["offload_restored_pages"], m["snapshot_restores"]) == (before[0] + 3, before[1] + 1)
