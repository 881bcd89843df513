"""Checkpoints (tiny preset, CPU): HF layout round trip, Orbax, random init, sharding, and bad input.

Compiles the model once (one `paths.forward` on a short sequence) and `init_params` twice: the shared
`tiny_params` fixture here and `random_init` on a 2-device mesh in a subprocess; everything else is file
I/O on a ~1.3 MB checkpoint.
"""

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints import CheckpointError, import_hf, load, restore_orbax, save_orbax, write_hf
from checkpoints.hf_config import to_hf_dict
from checkpoints.hf_layout import checkpoint_entries, stored_tensors
from checkpoints.hf_manifest import INDEX_NAME
from checkpoints.host_quant import dequant_fp4, dequant_fp8_block, dequant_rows32, e8m0_to_f32
from checkpoints.loader import to_bf16_weights
from checkpoints.random_params import CHUNK_ELEMENTS, _chunked, chunk_rows, plan
from checkpoints.safetensors_io import SafeOpen, ShardWriter, save_file
from checkpoints.tree import flat
from dsv41_jax import paths, quant
from dsv41_jax.config import ModelConfig
from dsv41_jax.params import _init_tensor, expert_weight, lin_weight, tensor_specs

from .conftest import DATA

REF_LISTING = Path("/work/ref/tiny_state_dict.txt")
ROOT = Path(__file__).resolve().parents[1]


def _bytes(x):
    a = np.asarray(x)
    return np.ascontiguousarray(a).view(np.uint8) if a.size else a


def assert_trees_identical(a, b):
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape, k
        assert np.array_equal(_bytes(fa[k]), _bytes(fb[k])), k


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tiny, tiny_params):
    d = tmp_path_factory.mktemp("hf") / "tiny"
    info = write_hf(tiny, tiny_params, d, shard_size_mb=0.25, progress=False)
    assert info["shards"] >= 4  # several shards, so weights and scales straddle files
    return d


MESH_SCRIPT = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=2"  # the parent's flags + 2 devices
import jax, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from checkpoints import import_hf, load, random_init, save_orbax
from checkpoints.tree import flat
hf, ob = sys.argv[1:]
assert len(jax.devices()) == 2
mesh = Mesh(np.array(jax.devices()), ("expert",))
cfg, ref = import_hf(hf, progress=False)  # the parent checked: bit-identical to init_params(tiny, 0)
rnd = random_init(cfg, 0, mesh)
p = import_hf(hf, mesh=mesh, slab_bytes=2048, progress=False)[1]
save_orbax(ob, cfg, p)
q = load(ob, mesh=mesh)[1]
for tree in (rnd, p, q):
    w = tree["layers"]["ffn"]["experts"]["w2"]["scale"]
    assert w.sharding.spec == P(None, "expert"), w.sharding
    assert w.addressable_shards[0].data.shape[1] == cfg.n_routed_experts // 2
    assert tree["embed"]["weight"].sharding.spec == P()
    a, b = flat(ref), flat(tree)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(np.asarray(a[k]).view(np.uint8),
                                                           np.asarray(b[k]).view(np.uint8)), k
other = random_init(cfg, 1, mesh)  # the seed is traced: same program, other values
assert not np.array_equal(np.asarray(other["embed"]["weight"]), np.asarray(ref["embed"]["weight"]))
print("MESH-OK")
"""


@pytest.fixture(scope="module")
def loaded(hf_dir):
    # a tiny slab budget exercises the preallocate-and-update path, incl. FP8 row ranges inside one tensor
    return import_hf(hf_dir, slab_bytes=2048, progress=False)


# ----------------------------------------------------------------------------- layout and config
def test_layout_matches_official_names():
    full = stored_tensors(ModelConfig.preset("full"))
    names = [s.name for s in full]
    assert len(names) == len(set(names))
    count = {k: sum(n.endswith(k) for n in names) for k in
             ("attn.compressor.wkv.weight", "attn.compressor.wgate.weight", "attn.indexer.wq_b.weight",
              "attn.indexer.wk.weight", "engram.embed.weight")}
    assert count == {"attn.compressor.wkv.weight": 4, "attn.compressor.wgate.weight": 3,
                     "attn.indexer.wq_b.weight": 8, "attn.indexer.wk.weight": 4, "engram.embed.weight": 2}
    if not REF_LISTING.exists():
        pytest.skip("reference state_dict listing not available")
    ref = {}
    for line in REF_LISTING.read_text().splitlines():
        n, shape, dt = line.split("\t")
        ref[n] = (tuple(int(x) for x in shape.strip("[]").split(",") if x.strip()), dt)
    ours = {s.name: (tuple(s.shape), str(s.dtype)) for s in stored_tensors(ModelConfig.preset("tiny"))}
    # the reference module holds wo_a dequantized (bf16, no scale), head and ratio-2 compressors in f32,
    # experts as float4_e2m1fn_x2; the checkpoint stores FP8+scale / bf16 / bf16 / I8 of the same shape
    assert set(ours) - set(ref) == {f"layers.{l}.attn.wo_a.scale" for l in range(8)}
    assert set(ref) <= set(ours)
    module_only = {"head.weight": "float32", "attn.wo_a.weight": "bfloat16", "compressor.wkv.weight": "float32",
                   "compressor.wgate.weight": "float32", "w1.weight": "float4_e2m1fn_x2",
                   "w2.weight": "float4_e2m1fn_x2", "w3.weight": "float4_e2m1fn_x2"}
    for n, (shape, dt) in ref.items():
        assert ours[n][0] == shape, n
        if ours[n][1] != dt:
            assert any(n.endswith(k) and dt == v for k, v in module_only.items()), (n, ours[n], dt)


@pytest.mark.parametrize("preset", ["tiny", "small", "medium", "full"])
def test_to_hf_dict_inverts_from_hf_dict(preset):
    cfg = ModelConfig.preset(preset)
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(to_hf_dict(cfg)))) == cfg


def test_to_hf_dict_is_the_official_config():
    official = json.loads(Path(DATA, "deepseek_v41_config.json").read_text())
    ours = to_hf_dict(ModelConfig.preset("full"))
    assert ours["text_config"] == official["text_config"]
    assert ours["quantization_config"] == official["quantization_config"]


def test_written_config_is_the_preset(hf_dir, tiny):
    assert ModelConfig.from_hf_config(hf_dir) == tiny


# ----------------------------------------------------------------------------- round trips
def test_hf_round_trip_bit_identical(tiny, tiny_params, hf_dir, loaded):
    cfg, params = loaded
    assert cfg == tiny and cfg.weight_format == "fp8"
    assert_trees_identical(params, tiny_params)
    assert params["layers"]["ffn"]["experts"]["w1"]["weight"].dtype == jnp.uint8  # stays MXFP4
    assert params["layers"]["attn"]["wq_a"]["weight"].dtype == jnp.float8_e4m3fn  # stays FP8
    for k, v in flat(params).items():  # random weights: no leaf may be all zero
        assert np.any(_bytes(v)), k
    _, whole = import_hf(hf_dir, progress=False)  # default slabs: one device_put per leaf
    assert_trees_identical(whole, tiny_params)


def test_hf_round_trip_identical_logits(tiny, tiny_params, loaded, tokens):
    cfg, params = loaded
    tokens = tokens[:1, :16]  # one short sequence: a single compile of the model
    want = np.asarray(paths.forward(tiny, tiny_params, tokens))
    got = np.asarray(paths.forward(cfg, params, tokens))
    assert np.isfinite(want).all() and want.std() > 0.1
    np.testing.assert_array_equal(got, want)


def _dequantized(cfg, params) -> dict:
    """{path: leaf} of `params` with every FP8/FP4 tensor dequantized to bf16 by the model's own code."""
    want = {}
    for path, t in tensor_specs(cfg).items():
        node = params
        for k in path:
            node = node[k]
        if t.fmt == "lin":
            want[path + ("weight",)] = lin_weight(node)
        elif t.fmt == "exp":
            want[path + ("weight",)] = expert_weight(node)
        elif t.fmt == "table":
            codes = jax.lax.bitcast_convert_type(node["scale"], jnp.uint8)
            want[path + ("weight",)] = quant.fp8_decode(node["weight"], codes, 32, jnp.bfloat16)
        else:
            want[path] = node
    return want


def test_bf16_import_dequantizes_exactly(tiny, tiny_params, hf_dir, tmp_path):
    cfg, params = import_hf(hf_dir, weight_format="bf16", slab_bytes=2048, progress=False)
    assert cfg == tiny.replace(weight_format="bf16")
    want = jax.jit(lambda p: _dequantized(tiny, p))(tiny_params)  # device dequantization, one compile
    got = flat(params)
    assert got.keys() == want.keys()
    for k in got:
        assert got[k].dtype == want[k].dtype, k
        assert np.array_equal(_bytes(got[k]), _bytes(want[k])), k
    # Orbax fp8 -> bf16 on device gives the same tree as the host dequantization
    save_orbax(tmp_path / "ob", tiny, tiny_params)
    cfg2, p2 = load(tmp_path / "ob", weight_format="bf16")
    assert cfg2 == cfg
    assert_trees_identical(p2, params)


def test_host_e8m0_decode_matches_device():
    codes = np.array([0, 1, 2, 100, 126, 127, 128, 200, 254, 255], np.uint8)
    got = e8m0_to_f32(codes.view(ml_dtypes.float8_e8m0fnu))
    want = np.asarray(quant.e8m0_code_to_f32(jnp.asarray(codes)))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("shape", [(40, 70), (64, 96)])
def test_host_dequant_matches_device(shape):
    rng = np.random.default_rng(shape[0])
    w = rng.standard_normal(shape, np.float32) * np.exp(rng.uniform(-30, 8, (shape[0], 1))).astype(np.float32)
    q, s = quant.quantize_weight_fp8(jnp.asarray(w))
    ref = np.asarray(quant.dequantize_weight_fp8(q, s))
    assert np.array_equal(_bytes(dequant_fp8_block(np.asarray(q), np.asarray(s))), _bytes(ref))
    if shape[1] % 32 == 0:
        p, s = quant.quantize_weight_fp4(jnp.asarray(w))
        ref = np.asarray(quant.dequantize_weight_fp4(p, s))
        assert np.array_equal(_bytes(dequant_fp4(np.asarray(p), np.asarray(s))), _bytes(ref))
        q, codes = quant.fp8_encode(jnp.asarray(w), 32)
        ref = np.asarray(quant.fp8_decode(q, codes, 32, jnp.bfloat16))
        s8 = np.asarray(codes).view(ml_dtypes.float8_e8m0fnu)
        assert np.array_equal(_bytes(dequant_rows32(np.asarray(q), s8)), _bytes(ref))


def test_bf16_layout_round_trip(tiny, tiny_params, tmp_path):
    cfg16, p16 = to_bf16_weights(tiny, jax.tree.map(jnp.copy, tiny_params))
    write_hf(cfg16, p16, tmp_path / "hf16", shard_size_mb=0.5, progress=False)
    assert "quantization_config" not in json.loads((tmp_path / "hf16" / "config.json").read_text())
    cfg, params = load(tmp_path / "hf16", progress=False)
    assert cfg == cfg16
    assert_trees_identical(params, p16)
    with pytest.raises(CheckpointError, match="weight_format 'fp8'"):
        load(tmp_path / "hf16", weight_format="fp8", progress=False)


def test_orbax_round_trip(tiny, loaded, tmp_path):
    from dsv41_jax.nnx_model import DSV41

    cfg, params = loaded
    save_orbax(tmp_path / "ob", cfg, params)
    cfg2, p2 = load(tmp_path / "ob")
    assert cfg2 == tiny and cfg2.weight_format == "fp8"
    assert_trees_identical(p2, params)
    with pytest.raises(CheckpointError, match="already holds"):
        save_orbax(tmp_path / "ob", cfg, params)
    model = DSV41(cfg, params=p2)  # an NNX module (or its nnx.state) saves the same tree
    save_orbax(tmp_path / "ob_nnx", cfg, model)
    assert_trees_identical(restore_orbax(tmp_path / "ob_nnx")[1], params)
    from flax import nnx

    save_orbax(tmp_path / "ob_state", cfg, nnx.state(model))
    assert_trees_identical(restore_orbax(tmp_path / "ob_state")[1], params)


@pytest.mark.parametrize("preset", ["tiny", "small", "medium", "full"])
def test_random_init_plan_is_bounded(preset):
    cfg = ModelConfig.preset(preset)
    groups = plan(cfg)
    seen = [i for _, items, _ in groups for i, _, _ in items]
    assert sorted(seen) == list(range(len(tensor_specs(cfg))))  # every tensor exactly once
    for kind, items, c in groups:
        n = sum(math.prod(t.shape) for _, _, t in items)
        if kind == "chunked":
            (_, _, t), = items
            assert t.shape[0] % c == 0 and n // t.shape[0] * c <= CHUNK_ELEMENTS
        else:
            assert n <= CHUNK_ELEMENTS or len(items) == 1
    if preset in ("tiny", "small"):  # every tensor is generated whole: random_init == init_params
        assert all(kind == "bundle" for kind, _, _ in groups)


def test_random_init_chunk_assembly(tiny):
    """A chunked tensor is chunk i = init of a (c, ...) tensor with fold_in(key, i), rows [i*c, (i+1)*c)."""
    specs, key = tensor_specs(tiny), jax.random.key(7)
    for path, limit in ((("layers", "ffn", "experts", "w1"), 2 ** 16), (("engram", 0, "wkv"), 2 ** 15)):
        t = specs[path]
        c = chunk_rows(t, limit)
        assert c is not None and c < t.shape[0]
        got = jax.jit(_chunked(tiny, path, t, c))(key)
        sub = dataclasses.replace(t, shape=(c, *t.shape[1:]))
        part = jax.jit(lambda k, sub=sub, path=path: _init_tensor(tiny, k, sub, path))
        parts = [part(jax.random.fold_in(key, i)) for i in range(t.shape[0] // c)]
        assert set(got) == {"/".join(map(str, p)) for p in parts[0]}
        for p in parts[0]:
            want = np.concatenate([np.asarray(x[p]) for x in parts])
            assert np.array_equal(_bytes(got["/".join(map(str, p))]), _bytes(want)), p


def test_mesh_random_init_load_and_orbax(hf_dir, tmp_path):
    """2 host devices in a subprocess: random_init on a mesh equals init_params (via the checkpoint, which
    test_hf_round_trip_bit_identical compares with init_params); HF import and Orbax restore shard experts."""
    # same XLA flags as this process: CPU codegen options (e.g. the optimization level) change f32 rounding
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", ""))
    r = subprocess.run([sys.executable, "-c", MESH_SCRIPT, str(hf_dir), str(tmp_path / "ob")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "MESH-OK" in r.stdout, r.stdout + r.stderr


# ----------------------------------------------------------------------------- bad input
def _shard_of(d: Path, name: str) -> Path:
    return d / json.loads((d / INDEX_NAME).read_text())["weight_map"][name]


def _rewrite(d: Path, name: str, *, new=None, drop=False, add: dict | None = None):
    """Rewrite the shard holding `name`: replace it with `new` or drop it; add more tensors to that shard."""
    f = _shard_of(d, name)
    with SafeOpen(f) as r:
        ts = {k: r.get(k) for k in r.keys()}
    if drop:
        del ts[name]
    elif new is not None:
        ts[name] = new
    ts.update(add or {})
    save_file(ts, f)
    index = json.loads((d / INDEX_NAME).read_text())
    if drop:
        del index["weight_map"][name]
    index["weight_map"].update({k: f.name for k in add or {}})
    (d / INDEX_NAME).write_text(json.dumps(index))


def _missing_tensor(d):
    _rewrite(d, "layers.3.attn.wkv.scale", drop=True)
    return "missing tensor layers.3.attn.wkv.scale"


def _missing_from_index(d):
    index = json.loads((d / INDEX_NAME).read_text())
    del index["weight_map"]["layers.5.ffn.experts.7.w3.weight"]
    (d / INDEX_NAME).write_text(json.dumps(index))
    return "missing tensor layers.5.ffn.experts.7.w3.weight"


def _wrong_shape(d):
    _rewrite(d, "layers.2.ffn.gate.weight", new=np.zeros((8, 32), ml_dtypes.bfloat16))
    return r"tensor layers.2.ffn.gate.weight in .*model-\d+-of-\d+.safetensors: shape \[8, 32\], expected \[8, 64\]"


def _wrong_dtype(d):
    _rewrite(d, "layers.1.attn.attn_sink", new=np.ones(4, ml_dtypes.bfloat16))
    return "tensor layers.1.attn.attn_sink in .*: dtype BF16, expected F32"


def _unknown_config_field(d):
    raw = json.loads((d / "config.json").read_text())
    raw["text_config"]["surprise_field"] = 1
    (d / "config.json").write_text(json.dumps(raw))
    return r"config.json: .*surprise_field"


def _truncated_shard(d):
    f = _shard_of(d, "norm.weight")
    os.truncate(f, f.stat().st_size - 100)
    return re.escape(f.name) + ": truncated: tensor "


def _corrupt_header(d):
    f = _shard_of(d, "layers.4.attn.wq_b.weight")
    with open(f, "r+b") as fh:
        fh.seek(8)
        fh.write(b"{not json at all")
    return re.escape(f.name) + ": corrupt header"


def _corrupt_header_length(d):
    f = _shard_of(d, "layers.4.attn.wq_b.weight")
    with open(f, "r+b") as fh:
        fh.write((2 ** 40).to_bytes(8, "little"))
    return re.escape(f.name) + ": corrupt header length"


def _missing_shard_file(d):
    f = _shard_of(d, "layers.6.attn.indexer.wq_b.weight")
    f.unlink()
    return re.escape(f.name) + ": missing shard file"


def _unexpected_tensor(d):
    _rewrite(d, "norm.weight", add={"layers.0.attn.bogus.weight": np.ones(3, np.float32)})
    return "unexpected tensor layers.0.attn.bogus.weight"


def _index_points_elsewhere(d):
    index = json.loads((d / INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    here = index["weight_map"]["norm.weight"]
    index["weight_map"]["norm.weight"] = next(f for f in files if f != here)
    (d / INDEX_NAME).write_text(json.dumps(index))
    return "tensor norm.weight: listed in .* does not hold it"


BAD = [_missing_tensor, _missing_from_index, _wrong_shape, _wrong_dtype, _unknown_config_field, _truncated_shard,
       _corrupt_header, _corrupt_header_length, _missing_shard_file, _unexpected_tensor, _index_points_elsewhere]


@pytest.mark.parametrize("corrupt", BAD, ids=[f.__name__[1:] for f in BAD])
def test_bad_checkpoint_fails_before_loading(corrupt, hf_dir, tmp_path, monkeypatch):
    d = tmp_path / "bad"
    shutil.copytree(hf_dir, d)
    pattern = corrupt(d)

    def no_transfer(*a, **k):  # validation must fail before any weight reaches a device
        raise AssertionError("device_put during a failing load")

    monkeypatch.setattr(jax, "device_put", no_transfer)
    with pytest.raises(CheckpointError, match=pattern):
        load(d, progress=False)


def test_ignored_tensors_are_accepted(hf_dir, tmp_path, tiny_params):
    d = tmp_path / "extra"
    shutil.copytree(hf_dir, d)
    _rewrite(d, "norm.weight", add={"layers.0.ffn.gate.bias_vl": np.ones(8, np.float32),
                                    "mtp.0.embed.weight": np.ones((2, 64), ml_dtypes.bfloat16)})
    assert_trees_identical(load(d, progress=False)[1], tiny_params)


def test_bad_orbax_config(tiny, loaded, tmp_path):
    cfg, params = loaded
    save_orbax(tmp_path / "ob", cfg, params)
    p = tmp_path / "ob" / "dsv41_config.json"
    good = json.loads(p.read_text())
    raw = json.loads(p.read_text())
    raw["config"]["surprise_field"] = 1
    p.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="surprise_field"):
        load(tmp_path / "ob")
    raw = dict(good, config=dict(good["config"], moe_inter_dim=96))
    p.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="parameter .*'experts', 'w1'"):
        load(tmp_path / "ob")
    with pytest.raises(CheckpointError, match="neither an HF checkpoint"):
        load(tmp_path)


def test_safetensors_writer(tmp_path):
    ts = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(5, ml_dtypes.bfloat16),
          "c": np.array([1, 2], ml_dtypes.float8_e4m3fn), "d": np.zeros((0, 4), np.int8)}
    save_file(ts, tmp_path / "x.safetensors", {"format": "pt"})
    with SafeOpen(tmp_path / "x.safetensors") as r:
        assert r.keys() == list(ts) and r.metadata == {"format": "pt"}
        for k, v in ts.items():
            got = r.get(k)
            assert got.dtype == v.dtype and np.array_equal(_bytes(got), _bytes(v))
    with pytest.raises(CheckpointError, match="tensor b .*where a"):
        with ShardWriter(tmp_path / "y.safetensors", [("a", np.float32, (1,))]) as w:
            w.write("b", np.zeros(1, np.float32))
    with pytest.raises(CheckpointError, match="only 0 of 1"):
        ShardWriter(tmp_path / "z.safetensors", [("a", np.float32, (1,))]).close()


def test_entries_cover_every_parameter(tiny):
    from dsv41_jax.params import param_specs

    paths_ = {e.path for e in checkpoint_entries(tiny)}
    leaves = {p[:-1] if p[-1] in ("weight", "scale") and p[:-1] in paths_ else p for p in param_specs(tiny)}
    assert leaves == paths_


def test_packed_shards_round_trip_under_a_size_limit(hf_dir, tmp_path, monkeypatch):
    """repack: every file under the limit, big shards xz-compressed; the loader reads the packed checkpoint
    through a decompression cache and gets the same tensors byte for byte; a damaged .xz is a clear error."""
    from checkpoints import packed_shards

    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "packed"
    limit = 60_000
    files = packed_shards.repack(hf_dir, out, max_bytes=50_000, limit=limit)
    on_disk = {p.name: p.stat().st_size for p in out.iterdir() if p.name.startswith("model")}
    assert on_disk == files and max(files.values()) <= limit
    xz = [n for n in files if n.endswith(".xz")]
    assert xz and len(files) > 2  # some shards compressed, the rest plain
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == {n.removesuffix(".xz") for n in files if n != INDEX_NAME}
    assert (out / "config.json").read_bytes() == (hf_dir / "config.json").read_bytes()
    ref_cfg, ref = load(hf_dir, progress=False)
    cfg, got = load(out, progress=False)
    assert cfg == ref_cfg
    assert_trees_identical(got, ref)
    cached = sorted((tmp_path / "cache" / "shards").glob("*/*"))
    assert sorted(p.name for p in cached) == sorted(n.removesuffix(".xz") for n in xz)
    # a second load reuses the decompressed files; a changed .xz gets its own cache entry (content-addressed)
    mtimes = [p.stat().st_mtime_ns for p in cached]
    load(out, progress=False)
    assert [p.stat().st_mtime_ns for p in cached] == mtimes
    damaged = out / xz[0]
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="cannot decompress"):
        load(out, progress=False)
    assert not list((tmp_path / "cache" / "shards").glob("*/*.safetensors.*"))  # no half-written file left
