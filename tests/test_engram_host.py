"""Host Engram tables (--engram-config cpu_offload; serving/engine/engram_host.py, checkpoints/host_tables.py): the
gathered-row path gives exactly the device path's outputs, the tables never reach a device, one host copy is shared,
and bad table tensors are rejected before anything is served."""

import dataclasses
import gc
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import host_tables
from checkpoints.safetensors_io import CheckpointError
from dsv41_jax import engram_rows, layers
from dsv41_jax.config import ModelConfig
from dsv41_jax.params import _init_tensor, init_params, tensor_specs
from serving.engine import Engine, EngineArgs, SamplingParams
from serving.engine.config import SMALL_ENGINE_ARGS, shared_cache_dir
from serving.engine.engram_host import EngramConfig

pytestmark = pytest.mark.timeout(600)
ARGS = dict(SMALL_ENGINE_ARGS, enable_prompt_logprobs=False, compilation_cache_dir=shared_cache_dir())
HOST = {"cpu_offload": True, "dp_shared_memory": False}


def packed(cfg, params):
    """Each Engram table of `params` in the host row format."""
    fmt = engram_rows.row_format(cfg)
    return [engram_rows.pack_rows(fmt, np.asarray(p["embed"]["weight"]),
                                  np.asarray(p["embed"]["scale"]) if "scale" in p["embed"] else None)
            for p in params["engram"]]


# ---------------------------------------------------------------------------------------------- the row format
def table_node(cfg, seed=0):
    """An Engram table leaf node of `cfg` (its init, without building the whole model)."""
    path = ("engram", 0, "embed")
    t = tensor_specs(cfg)[path]
    vals = jax.jit(lambda k: _init_tensor(cfg, k, t, path))(jax.random.key(seed))
    return {k[-1]: v for k, v in vals.items()}


@pytest.mark.parametrize("preset,fmt", [("tiny", "fp8"), ("tiny", "bf16"), ("small", "fp8"), ("medium", "bf16")])
def test_gathered_rows_decode_to_the_device_lookup(preset, fmt):
    """Rows of 33 B (tiny fp8), 64 B (tiny bf16), 66 B (small), 512 B (medium): the in-program decoding of gathered
    rows equals the device table lookup bit for bit."""
    cfg = ModelConfig.preset(preset, weight_format=fmt)
    if preset == "medium":  # its table (482K rows) is too big for this test: a table of the same row format
        cfg = cfg.replace(engram_num_embeddings=(4099, 4099))
    node = table_node(cfg)
    fmt_ = engram_rows.row_format(cfg)
    t = engram_rows.pack_rows(fmt_, np.asarray(node["weight"]), np.asarray(node["scale"]) if "scale" in node else None)
    ids = np.random.default_rng(0).integers(0, cfg.engram_rows[0], (2, 5, cfg.engram_layout.n_cols))
    want = jax.jit(lambda p, i: layers.engram_lookup(cfg, p, i))({"embed": node}, ids)
    got = jax.jit(lambda r: engram_rows.decode_rows(cfg, r, layers.cdtype(cfg)))(jnp.asarray(t[ids]))
    assert np.isfinite(np.asarray(want, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    w, s = engram_rows.unpack_rows(fmt_, t)
    np.testing.assert_array_equal(w.view(np.uint8), np.asarray(node["weight"]).view(np.uint8))
    assert (s is None) == (fmt == "bf16")


# ---------------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def cfg2(tiny):
    """tiny with a second Engram layer (layers 1 and 3): two host tables, two row inputs per program."""
    return tiny.replace(engram_layer_ids=(1, 3))


@pytest.fixture(scope="module")
def engines(cfg2):
    """Device tables (parameters built on the device) and host tables (the same config's random init: every other
    weight on the device, the tables generated on the host with the same values, never on a device)."""
    dev = Engine(cfg2, EngineArgs(**ARGS), params=jax.jit(lambda: init_params(cfg2, 0))(), progress=False)
    gc.collect()
    before = {id(a) for a in jax.live_arrays()}  # arrays other tests of this worker may still hold
    host = Engine(cfg2, EngineArgs(**ARGS, engram_config=HOST), progress=False)
    host.arrays_before = before
    return dev, host


def generate(eng, prompts, n=6, concurrent=True):
    out = {}
    for i, p in enumerate(prompts):
        rid = f"g{np.random.randint(1 << 30)}-{i}"
        out[rid] = {"ids": [], "lps": [], "cached": 0}
        eng.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1))
        if not concurrent:
            _drain(eng, out)
    _drain(eng, out)
    return list(out.values())


def _drain(eng, out):
    for o in eng.run_until_done():
        r = out[o.request_id]
        r["ids"] += o.new_token_ids
        r["lps"] += [d[t] for d, t in zip(o.new_logprobs or [], o.new_token_ids)]
        r["cached"] = o.num_cached_tokens


def test_prefill_and_batched_decode_equal_device_tables(engines):
    dev, host = engines
    rng = np.random.default_rng(0)
    for lens in ((150, 40, 9, 129, 65), (190, 104, 57)):  # 2 chunks, 1 chunk, shorter than W; batched decodes
        prompts = [rng.integers(0, 512, n).tolist() for n in lens]
        a, b = generate(dev, prompts), generate(host, prompts)
        assert [r["ids"] for r in a] == [r["ids"] for r in b]
        assert [r["lps"] for r in a] == [r["lps"] for r in b]  # bit-identical logprobs
    m = host.metrics.snapshot()
    assert m["histograms"]["engram_lookup"]["count"] > 0 and m["histograms"]["engram_wait"]["count"] > 0
    assert m["counters"]["engram_rows"] > 0
    text = host.metrics.prometheus()
    assert "dsv41:engram_lookup_seconds_count" in text and "dsv41:engram_wait_seconds_bucket" in text
    assert dev.metrics.snapshot()["histograms"]["engram_lookup"]["count"] == 0


def test_warm_turn_replay_across_the_hit_boundary_equals_device_tables(engines):
    """Turn 2 hits the cached prefix; bounded replay restarts W tokens before the hit's end, so the first replayed
    rows' Engram look-back reaches into tokens that are not recomputed."""
    dev, host = engines
    rng = np.random.default_rng(1)
    p1, extra = rng.integers(0, 512, 150).tolist(), rng.integers(0, 512, 30).tolist()
    res = []
    for eng in (dev, host):
        first = generate(eng, [p1], n=4)[0]
        second = generate(eng, [p1 + first["ids"] + extra])[0]
        assert second["cached"] > 0
        res.append((first, second))
    assert res[0] == res[1]


def test_prefetched_first_chunks_are_used_and_dropped(engines):
    """A request's first chunk is gathered when it is added (next in line), its next chunk when this one is
    dispatched: no call of a lone request misses its rows, and no span outlives its request."""
    dev, host = engines
    rng = np.random.default_rng(2)
    miss0 = host.metrics.snapshot()["counters"]["engram_prefetch_misses"]
    prompts = [rng.integers(0, 512, n).tolist() for n in (200, 70)]  # 2 chunks (128 + 72), 1 chunk
    a, b = generate(dev, prompts, concurrent=False), generate(host, prompts, concurrent=False)
    assert [r["ids"] for r in a] == [r["ids"] for r in b] and [r["lps"] for r in a] == [r["lps"] for r in b]
    assert host.metrics.snapshot()["counters"]["engram_prefetch_misses"] == miss0
    assert not host.engram.spans


def test_tables_never_enter_device_memory(engines, cfg2):
    dev, host = engines
    r = host.runner
    assert all("embed" not in p for p in r.params["engram"]) and "embed" in dev.runner.params["engram"][0]
    rows = set(cfg2.engram_rows)
    dev_tables = jax.tree.leaves([p["embed"] for p in dev.runner.params["engram"]])
    gc.collect()
    for a in jax.live_arrays():  # of the arrays made since the host engine's start, none has a table's shape
        if a.shape and a.shape[0] in rows and id(a) not in host.arrays_before:
            assert any(a is x for x in dev_tables), a.shape
    fmt = engram_rows.row_format(cfg2)
    for key in r.programs:  # every program's arguments: no table, and one gathered-rows input per Engram layer
        shapes = [tuple(x.shape) for x in jax.tree.leaves(r.programs[key].args_info)]  # the compiled programs
        assert not any(s and s[0] in rows for s in shapes), (key, shapes)
        assert shapes.count((key.batch, key.tokens, cfg2.engram_layout.n_cols, fmt.row_bytes)) == 2
    assert host.stats()["engram_host_tables"]["bytes"] == sum(engram_rows.table_bytes(cfg2))


def test_config_flag_and_default_threshold():
    assert EngramConfig.parse('{"cpu_offload": true}').cpu_offload is True
    with pytest.raises(ValueError, match="unknown key"):
        EngramConfig.parse('{"cpu_ofload": true}')
    with pytest.raises(ValueError, match="JSON"):
        EngramConfig.parse("{cpu_offload}")
    assert EngramConfig().resolved(ModelConfig.preset("full")).cpu_offload  # 189 GiB: host memory by default
    assert not EngramConfig().resolved(ModelConfig.preset("medium")).cpu_offload  # 0.5 GiB: the device
    assert sum(engram_rows.table_bytes(ModelConfig.preset("full"))) == (384006168 + 384016682) * (256 + 8)
    from serving.run import build_parser

    a = build_parser().parse_args(["--engram-config", json.dumps({"cpu_offload": True})])
    assert EngramConfig.parse(a.engram_config).cpu_offload


def test_speculation_with_host_tables_is_refused(tiny):
    """Not supported together yet (the verify rows' Engram rows would be the drafts'): a clear error up front."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="host Engram tables"):
        EngineArgs(**ARGS, engram_config=HOST, speculative_config=spec).resolved(tiny)
    assert EngineArgs(**ARGS, speculative_config=spec).resolved(tiny).speculative.num_speculative_tokens == 2


# ---------------------------------------------------------------------------------------------- the feeder's paths
class _Req:
    def __init__(self, rid, tokens):
        self.request_id, self.tokens = rid, tokens


@dataclasses.dataclass
class _Chunk:  # the part of a program's StepInputs the feeder touches
    tokens: np.ndarray
    engram_rows: tuple = ()


@dataclasses.dataclass
class _Inputs:
    chunk: _Chunk


def _inputs(B, T):
    return _Inputs(_Chunk(np.zeros((B, T), np.int32)))


@pytest.fixture(scope="module")
def feeder_parts(cfg2):
    from dsv41_jax.engram_hash import EngramHasher

    tables = host_tables.from_random(cfg2, 3, host_tables.StoreOptions(shared=False))
    return cfg2, tables, EngramHasher(cfg2)


def _want(hasher, tables, tokens, pos0, n):
    """Rows of positions [pos0, pos0 + n) by the hasher over the whole sequence and a plain index."""
    ids = hasher.hash_ids(np.asarray(tokens)[None])[0, pos0:pos0 + n]
    return [tables.arrays[e][ids[:, e]] for e in range(len(tables.arrays))]


def test_feeder_paths_give_the_rows_of_a_plain_lookup(feeder_parts, monkeypatch):
    """Every path of EngramFeeder (pieces over threads, per-layer eager copies, staging of prefetched spans, inline
    decode rows, worker decode rows, a wrong guess gathered again) gives the rows of hashing the whole sequence
    and indexing the tables; pooled buffers are poisoned when handed out and return once copied."""
    from serving.engine import engram_host as eh

    cfg, tables, hasher = feeder_parts
    monkeypatch.setattr(eh, "SPLIT_ROWS", 64)  # tiny spans still split: pieces of 2 tokens x 2 layers x 4 cols
    monkeypatch.setattr(eh, "PIECE_ROWS", 16)
    puts = []

    def put(bufs, alias):
        assert not alias  # nothing registered on CPU
        puts.append([b.shape for b in bufs])
        return [jax.device_put(b.copy()) for b in bufs]

    f = eh.EngramFeeder(cfg, tables, hasher, put, gather_threads=3)
    get = f.staging.get

    def poisoned(shape):
        bufs = get(shape)
        for x in bufs:
            x.fill(0xAB)
        return bufs

    f.staging.get = poisoned
    rng = np.random.default_rng(4)
    a, b, c = (_Req(n, rng.integers(0, cfg.vocab_size, k).tolist()) for n, k in (("a", 90), ("b", 61), ("c", 7)))

    def check(arrays, row, req, pos0, n):
        for e, w in enumerate(_want(hasher, tables, req.tokens, pos0, n)):
            np.testing.assert_array_equal(np.asarray(arrays[e])[row, :n], w)

    f.prefetch(a, 0, 40, 64)  # eager: the one-chunk call takes its device arrays, one put per layer
    got = f.inputs(_inputs(1, 64), [(0, a, 0, 40)]).chunk.engram_rows
    assert len(got) == 2 and puts[-2:] == [[(1, 64, f.C, f.RB)]] * 2
    check(got, 0, a, 0, 40)
    f.prefetch(a, 40, 30, 32)
    f.prefetch(b, 20, 9, 32)
    got = f.inputs(_inputs(2, 32), [(1, a, 40, 30), (0, b, 20, 9)]).chunk.engram_rows  # staged (B = 2)
    check(got, 1, a, 40, 30)
    check(got, 0, b, 20, 9)
    f.prefetch(b, 0, 5, 32)  # a wrong guess (too short): gathered again
    got = f.inputs(_inputs(1, 32), [(0, b, 0, 20)]).chunk.engram_rows
    check(got, 0, b, 0, 20)
    assert not f.spans
    for inline in (True, False):  # decode rows of 3 requests: on the engine thread, or a worker's prefetch
        monkeypatch.setattr(eh, "INLINE_ROWS", 4096 if inline else 0)
        for r in (a, b, c):
            r.tokens.append(int(rng.integers(0, cfg.vocab_size)))
        f.prefetch_decode([a, b, c])
        assert len(f.spans) == (0 if inline else 3)
        got = f.inputs(_inputs(4, 1), [(j, r, len(r.tokens) - 1, 1) for j, r in enumerate((c, a, b))])
        for j, r in enumerate((c, a, b)):
            check(got.chunk.engram_rows, j, r, len(r.tokens) - 1, 1)
    f.prefetch(c, 0, 3, 32)
    f.forget("c")
    f.close()  # waits for the recycling
    assert not f.spans and sum(len(v) for v in f.staging.free.values()) >= 2
    monkeypatch.setattr(eh, "INLINE_ROWS", 4096)
    g = eh.EngramFeeder(cfg, tables, hasher, put, in_call=True)  # decode rows ride in the program call
    n_puts = len(puts)
    for r in (a, b, c):
        r.tokens.append(int(rng.integers(0, cfg.vocab_size)))
    d = _Req("d", [int(rng.integers(0, cfg.vocab_size))])  # a first token: less history than the n-grams need
    got = g.inputs(_inputs(4, 1), [(j, r, len(r.tokens) - 1, 1) for j, r in enumerate((b, c, a, d))]).chunk.engram_rows
    assert len(puts) == n_puts and all(isinstance(x, np.ndarray) for x in got)
    for j, r in enumerate((b, c, a, d)):
        check(got, j, r, len(r.tokens) - 1, 1)
    g.prefetch(a, 0, 40, 64)  # a prefill chunk still goes through put
    assert not isinstance(g.inputs(_inputs(1, 64), [(0, a, 0, 40)]).chunk.engram_rows[0], np.ndarray)
    g.close()


class _Mapper:
    """A stand-in for the device client's dma_map / dma_unmap (the CPU client has none): records the ranges."""

    def __init__(self):
        self.live, self.mapped = {}, 0

    def map(self, ptr, size):
        assert ptr % 4096 == 0 and ptr not in self.live
        self.live[ptr] = size
        self.mapped += 1

    def unmap(self, ptr):
        del self.live[ptr]


class _Copy:
    """A device array stand-in whose transfer completes when the test says so."""

    def __init__(self, src: np.ndarray, done):
        self.src, self.done, self.value = src, done, None

    def block_until_ready(self):
        self.done.wait(30)
        self.value = self.src.copy()  # what the transfer read
        return self


def test_registered_staging_is_reused_only_after_its_copy(feeder_parts):
    """Pinned staging (engram_staging.Staging with a mapper): every put gets views of registered slabs with alias
    True, one call for all layers; a buffer set is handed out again only after all its copies completed; a buffer is
    unregistered when freed; outputs equal a plain lookup."""
    import threading

    from serving.engine import engram_host as eh

    cfg, tables, hasher = feeder_parts
    m = _Mapper()
    done = threading.Event()
    calls = []

    def put(bufs, alias):
        assert alias and all(b.ctypes.data in m.live and b.nbytes <= m.live[b.ctypes.data] for b in bufs)
        calls.append(len(bufs))
        return [_Copy(b, done) for b in bufs]

    f = eh.EngramFeeder(cfg, tables, hasher, put, pinned=True, mapper=(m.map, m.unmap))
    assert f.alias
    rng = np.random.default_rng(6)
    reqs = [_Req(f"d{i}", rng.integers(0, cfg.vocab_size, 12).tolist()) for i in range(3)]
    got = f.inputs(_inputs(4, 1), [(j, r, 11, 1) for j, r in enumerate(reqs)]).chunk.engram_rows  # inline decode
    assert calls == [2] and m.mapped == 2  # one registered buffer per layer
    got2 = f.inputs(_inputs(4, 1), [(j, r, 10, 1) for j, r in enumerate(reqs)]).chunk.engram_rows
    assert m.mapped == 4  # the first set's copy has not completed: not reused
    assert got2[0].src.base is not got[0].src.base  # another buffer
    done.set()
    for arrays, pos in ((got, 11), (got2, 10)):
        for a in arrays:
            a.block_until_ready()
        for j, r in enumerate(reqs):
            for e, w in enumerate(_want(hasher, tables, r.tokens, pos, 1)):
                np.testing.assert_array_equal(arrays[e].value[j, :1], w)
    f._release_ex.submit(lambda: None).result()  # the recycling has run
    f.inputs(_inputs(4, 1), [(0, reqs[0], 9, 1)])
    assert m.mapped == 4  # a completed set came back
    f.close()
    del f, got, got2, arrays, a  # (the loop above holds the last set)
    gc.collect()
    assert m.mapped == 4 and not m.live  # every buffer was unregistered when its memory was freed


def test_pinned_staging_falls_back_on_cpu(caplog, monkeypatch):
    """On the CPU client there is no registration: Staging says so once and hands out plain buffers, put with
    copies; a GPU client whose dma_map fails gets plain buffers put with may_alias (staged off the caller)."""
    from serving.engine import engram_staging as es

    es._said.clear()
    with caplog.at_level("INFO", logger=es.__name__):
        a, b = es.Staging(2, pinned=True), es.Staging(2, pinned=True)
    assert not a.mapped and not b.mapped and not a.alias and a.registered == 0
    said = [r for r in caplog.records if "pinned staging unavailable" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO"  # expected on CPU (the default is on): no warning
    bufs = a.get((3, 4, 5))
    assert len(bufs) == 2 and bufs[0].shape == (3, 4, 5) and bufs[0].dtype == np.uint8
    assert not es.Staging(2, pinned=False).mapped
    monkeypatch.setattr(es, "_client_mapper", lambda: (None, "dma_map failed"))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with caplog.at_level("INFO", logger=es.__name__):
        g = es.Staging(2, pinned=True)
    assert g.alias and not g.mapped and len(g.get((2, 3))) == 2
    assert [r.levelname for r in caplog.records if "dma_map failed" in r.getMessage()] == ["WARNING"]
    assert not es.Staging(2, pinned=False).alias


# ---------------------------------------------------------------------------------------------- storage
def test_one_shared_copy_per_host(tiny, tmp_path):
    opts = host_tables.StoreOptions(shm_dir=str(tmp_path))
    a = host_tables.from_random(tiny, 5, opts)
    b = host_tables.from_random(tiny, 5, opts)  # a second user maps the file, does not fill it again
    assert a.created and not b.created and a.path == b.path and os.path.exists(a.path)
    np.testing.assert_array_equal(a.arrays[0], b.arrays[0])
    assert not b.arrays[0].flags.writeable
    code = ("import sys; import numpy as np; from checkpoints import host_tables; from dsv41_jax.config import "
            "ModelConfig; t = host_tables.from_random(ModelConfig.preset('tiny'), 5, host_tables.StoreOptions("
            "shm_dir=sys.argv[1])); print(int(t.created), int(t.arrays[0].astype(np.int64).sum()))")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout.split()
    assert out == ["0", str(int(a.arrays[0].astype(np.int64).sum()))]  # another process: the same copy
    want = packed(tiny, jax.jit(lambda: init_params(tiny, 5))())[0]
    np.testing.assert_array_equal(a.arrays[0], want)  # the device init's values
    a.close()
    assert os.path.exists(b.path)  # b still uses it
    path = b.path
    b.close()
    assert not os.path.exists(path)  # the last user removed it
    with open(path, "wb") as f:  # a damaged file under the final name is rejected, never used
        f.write(b"DSV41ENG" + bytes(100))
    with pytest.raises(ValueError, match="does not match"):
        host_tables.from_random(tiny, 5, opts)


@pytest.fixture(scope="module")
def hf_dir(tiny, tiny_params, tmp_path_factory):
    from checkpoints.make_hf import write_hf

    d = tmp_path_factory.mktemp("hf")
    write_hf(tiny, tiny_params, d / "ckpt", shard_size_mb=0.05)
    return d / "ckpt"


def _table_location(d):
    from checkpoints.hf_manifest import inspect

    man = inspect(d)
    (wn, _), = host_tables.table_tensors(man, man.cfg)
    return man.tensors[wn]


def test_hf_tables_read_straight_into_host_memory(tiny, tiny_params, hf_dir):
    import checkpoints

    cfg, params, tables = checkpoints.load(hf_dir, host_tables=host_tables.StoreOptions(shared=False))
    assert "embed" not in params["engram"][0]
    np.testing.assert_array_equal(tables.arrays[0], packed(tiny, tiny_params)[0])
    tables.close()


def test_bad_or_truncated_table_shards_are_rejected_before_serving(hf_dir, tmp_path):
    import shutil

    loc = _table_location(hf_dir)
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    shard = bad / loc.path.name
    with open(shard, "r+b") as f:  # row 7 of the table gets an E4M3 NaN code
        f.seek(loc.info.start + 7 * loc.info.shape[1] + 3)
        f.write(b"\x7f")
    args = EngineArgs(**ARGS, engram_config=HOST)
    with pytest.raises(CheckpointError, match=r"row 7 holds a NaN"):
        Engine(str(bad), args, progress=False)
    cut = tmp_path / "cut"
    shutil.copytree(hf_dir, cut)
    os.truncate(cut / loc.path.name, loc.info.start + 10)  # the shard ends inside the table
    with pytest.raises(CheckpointError, match="truncated"):
        Engine(str(cut), args, progress=False)


def test_data_parallel_programs_take_rank_blocks_of_rows(cfg2):
    """DEP2 (lowered on an abstract mesh, no devices needed): every rank gets its block of each call's rows."""
    from jax.sharding import PartitionSpec as P

    from dsv41_jax.sharding import Parallel
    from serving.engine.runner import Runner
    from serving.engine.step_io import DECODE, ProgramKey

    par = Parallel("dp", 2, ep=True, a2a="padded")
    args = EngineArgs(**ARGS)
    args.parallel, args.engram, args.kernels, args.num_pages = par, EngramConfig(cpu_offload=True), "xla", 33
    r = Runner.for_lowering(cfg2, args, 4, par.abstract_mesh())
    key = ProgramKey(DECODE, 8)
    shape = (16, 1, cfg2.engram_layout.n_cols, engram_rows.row_format(cfg2).row_bytes)  # 2 ranks x 8 rows
    rows = r._abstract_inputs(key).chunk.engram_rows
    assert [x.shape for x in rows] == [shape, shape] and all(x.sharding.spec == P("data") for x in rows)
    assert r.inputs(key).chunk.engram_rows[0].shape == shape and r.inputs(key).chunk.engram_ids is None
    text = r.lower(key, platforms=("cpu",)).as_text()
    assert text.count(f"tensor<16x1x{shape[2]}x{shape[3]}xui8>") >= 2  # the rows are arguments of the program
