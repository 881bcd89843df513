import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_hash import EngramHasher, hash_multipliers, is_prime


def slow_hash(tokens, layer, n, mult, primes, offsets, pad):
    """Position-by-position Python-int version of dsv41_jax/engram_hash.py's hashing."""
    out = []
    for t in range(len(tokens)):
        grams, blocked = [], False
        for k in range(n):
            blocked = blocked or t - k < 0
            grams.append(pad if blocked else int(tokens[t - k]))
        cols, h = [], grams[0] * int(mult[layer, 0])
        for i in range(1, n):
            h ^= grams[i] * int(mult[layer, i])
            for e, p in enumerate(primes[layer][i - 1]):
                cols.append(h % p + int(offsets[layer][(i - 1) * len(primes[layer][i - 1]) + e]))
        out.append(cols)
    return np.array(out)


def test_primes_and_layout():
    assert [p for p in range(90, 110) if is_prime(p)] == [97, 101, 103, 107, 109]
    tiny = ModelConfig.preset("tiny")
    assert tiny.engram_layout.primes == (((101, 103), (107, 109)),)
    assert tiny.engram_rows == (420,)


def test_multipliers_odd_and_bounded():
    m = hash_multipliers((1, 14), 4, 99092)
    assert m.shape == (2, 4) and np.all(m % 2 == 1)
    assert np.all(m < np.iinfo(np.int64).max // 99092)


def test_hash_matches_slow_and_continues_from_history():
    cfg = ModelConfig.preset("small")
    h = EngramHasher(cfg)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.vocab_size, (2, 23))
    ids = h.hash_ids(toks)
    lay = cfg.engram_layout
    for b in range(2):
        for li in range(len(lay.layer_ids)):
            ref = slow_hash(toks[b], li, lay.max_ngram_size, h.mult, lay.primes, h.offsets, h.pad)
            np.testing.assert_array_equal(ids[b, :, li], ref)
    # rows stay inside each layer's table and inside their own prime range
    assert np.all(ids >= 0) and np.all(ids < np.array(lay.num_embeddings)[None, None, :, None])
    # chunked hashing with carried history equals hashing the whole sequence
    hist = h.next_history(None, toks[:, :9])
    np.testing.assert_array_equal(h.hash_ids(toks[:, 9:], hist), ids[:, 9:])
    hist2 = h.next_history(hist, toks[:, 9:10])
    np.testing.assert_array_equal(h.hash_ids(toks[:, 10:11], hist2), ids[:, 10:11])
    # a different earlier token changes only the n-grams that contain it
    t2 = toks.copy()
    t2[:, 5] = (t2[:, 5] + 1) % cfg.vocab_size
    diff = np.any(h.hash_ids(t2) != ids, axis=(2, 3))
    assert not diff[:, :5].any() and diff[:, 5:8].all() and not diff[:, 8:].any()
