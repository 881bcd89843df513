"""On-device sampling: exact top-k / top-p / min-p masks against a numpy reference, temperature 0 = argmax,
seeded draws reproducible whatever the batch composition, and draws that follow the filtered distribution."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.engine.sampler import filtered_logits, sample

V = 64


def ref_mask(logits, temperature, top_k, top_p, min_p):
    """Which tokens may be drawn, from the definitions (numpy, one row)."""
    z = logits / (temperature if temperature > 0 else 1.0)
    order = np.argsort(-z, kind="stable")
    keep = np.ones(V, bool)
    if top_k > 0:
        keep &= z >= z[order[top_k - 1]]
    zk = np.where(keep, z, -np.inf)
    p = np.exp(zk - zk.max())
    p /= p.sum()
    ps = p[order]
    # smallest prefix (by descending probability) whose mass reaches top_p; ties with its last value kept
    n = int(np.searchsorted(np.cumsum(ps), top_p - 1e-7) + 1)
    keep &= z >= z[order[min(n, V) - 1]]
    zk = np.where(keep, z, -np.inf)
    p = np.exp(zk - zk.max())
    p /= p.sum()
    keep &= p >= min_p * p.max()
    return keep


CASES = [(1.0, -1, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, -1, 0.6, 0.0), (1.0, -1, 1.0, 0.2), (0.9, 10, 0.8, 0.05),
         (2.0, 1, 1.0, 0.0), (1.0, 64, 0.3, 0.0)]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", CASES)
def test_masks_are_exact(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(hash((temperature, top_k, top_p, min_p)) % 2 ** 32)
    logits = rng.normal(0, 2, (4, V)).astype(np.float32)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1.0  # a tie at the top
    B = logits.shape[0]
    z = np.asarray(filtered_logits(jnp.asarray(logits), jnp.full(B, temperature), jnp.full(B, top_k, jnp.int32),
                                   jnp.full(B, top_p), jnp.full(B, min_p)))
    for b in range(B):
        want = ref_mask(logits[b], temperature, top_k, top_p, min_p)
        np.testing.assert_array_equal(np.isfinite(z[b]), want)
        kept = want
        np.testing.assert_allclose(z[b][kept], (logits[b] / temperature)[kept], rtol=1e-6)


def _sample(logits, temperature, seeds, counters, top_k=-1, top_p=1.0, min_p=0.0):
    B = logits.shape[0]
    return sample(jnp.asarray(logits), jnp.full(B, temperature, jnp.float32), jnp.full(B, top_k, jnp.int32),
                  jnp.full(B, top_p, jnp.float32), jnp.full(B, min_p, jnp.float32),
                  jnp.asarray(seeds, jnp.uint32), jnp.asarray(counters, jnp.int32))


def test_temperature_zero_is_argmax_and_logprobs_are_raw():
    logits = np.random.default_rng(0).normal(0, 3, (5, V)).astype(np.float32)
    tok, tok_lp, top_ids, top_lp = _sample(logits, 0.0, np.arange(5), np.zeros(5), top_k=3, top_p=0.5)
    np.testing.assert_array_equal(np.asarray(tok), logits.argmax(-1))
    lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(np.asarray(tok_lp), lp[np.arange(5), logits.argmax(-1)], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(top_ids)[:, 0], logits.argmax(-1))
    np.testing.assert_allclose(np.asarray(top_lp), np.sort(lp, -1)[:, ::-1][:, :top_lp.shape[1]], rtol=1e-6)


def test_seeded_draws_reproducible_in_any_batch_position():
    rng = np.random.default_rng(1)
    row = rng.normal(0, 1, V).astype(np.float32)
    other = rng.normal(0, 1, (3, V)).astype(np.float32)
    a = np.asarray(_sample(row[None], 1.0, [42], [5])[0])[0]
    batch = np.concatenate([other[:2], row[None], other[2:]])
    b = np.asarray(_sample(batch, 1.0, [1, 2, 42, 3], [0, 0, 5, 0])[0])[2]
    assert a == b
    draws = {int(np.asarray(_sample(row[None], 1.0, [s], [5])[0])[0]) for s in range(40)}
    assert len(draws) > 5  # different seeds give different draws
    steps = {int(np.asarray(_sample(row[None], 1.0, [42], [c])[0])[0]) for c in range(40)}
    assert len(steps) > 5  # the step counter advances the stream


def test_draws_follow_the_filtered_distribution():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 1.5, V).astype(np.float32)
    n = 4000
    toks = np.asarray(_sample(np.repeat(logits[None], n, 0), 0.8, np.full(n, 7), np.arange(n), top_k=8)[0])
    keep = ref_mask(logits, 0.8, 8, 1.0, 0.0)
    assert set(np.unique(toks)) <= set(np.flatnonzero(keep))
    z = np.where(keep, logits / 0.8, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    freq = np.bincount(toks, minlength=V) / n
    assert np.abs(freq - p).max() < 0.03  # 4000 draws: standard error <= 0.008


def test_allowed_bitmask_restricts_greedy_and_sampled_choices():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, (3, V)).astype(np.float32)
    allowed_ids = [np.array([5, 40]), np.arange(0, V, 7), np.arange(V)]
    words = np.zeros((3, V // 32), np.uint32)
    for b, ids in enumerate(allowed_ids):
        for t in ids:
            words[b, t // 32] |= np.uint32(1 << (t % 32))
    for temp in (0.0, 1.0):
        for c in range(20):
            tok, tok_lp, _, _ = sample(jnp.asarray(logits), jnp.full(3, temp), jnp.full(3, -1, jnp.int32),
                                       jnp.ones(3), jnp.zeros(3), jnp.arange(3, dtype=jnp.uint32),
                                       jnp.full(3, c, jnp.int32), allowed=jnp.asarray(words))
            tok = np.asarray(tok)
            for b, ids in enumerate(allowed_ids):
                assert tok[b] in ids
            if temp == 0.0:
                assert tok[0] == allowed_ids[0][logits[0, allowed_ids[0]].argmax()]
                assert tok[2] == logits[2].argmax()  # an all-ones mask changes nothing
    lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))
    np.testing.assert_allclose(np.asarray(tok_lp), lp[np.arange(3), tok], rtol=1e-6)  # raw logprobs
