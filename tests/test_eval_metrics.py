"""Answer metrics on known strings, and the next-token divergence against a direct numpy computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax.eval import metrics as m
from kvzip_jax.eval.tasks.base import METRICS


def test_normalize():
    assert m.normalize("  The Answer, is: An APPLE!  ") == "answer is apple"
    assert m.normalize("Three cats and one dog; nine lives") == "3 cats and 1 dog 9 lives"
    assert m.normalize("someone atone the-end") == "someone atone theend"  # only whole words
    assert m.normalize("zero\tTwo\n\nEIGHT.") == "0 2 8"
    assert m.normalize("") == ""


def test_inclusion():
    assert m.inclusion("I think it is the Dolores Park, on a sunny day.", ["dolores park"]) == 1.0
    assert m.inclusion("The code is Seven.", ["7"]) == 1.0
    assert m.inclusion("Golden Gate", ["dolores park", "golden gate bridge"]) == 0.0
    assert m.inclusion("golden gate bridge!", ["dolores park", "golden gate bridge"]) == 1.0
    assert m.inclusion("", ["park"]) == 0.0


def test_all_included():
    assert m.all_included("VAR_A, var_b and VAR-C", ["var_a", "var_b", "varc", "var_d"]) == 0.75
    assert m.all_included("", ["x", "y"]) == 0.0
    assert m.all_included("x y", ["X", "Y"]) == 1.0


def test_exact_match():
    assert m.exact_match("The Eiffel Tower.", ["eiffel tower"]) == 1.0
    assert m.exact_match("Two", ["2"]) == 1.0
    assert m.exact_match("the eiffel tower in paris", ["eiffel tower"]) == 0.0
    assert m.exact_match("paris", ["london", "Paris!"]) == 1.0
    assert m.exact_match("", ["paris"]) == 0.0


def test_token_f1():
    # pred tokens [cat, sat, on, mat], ref [cat, on, mat, today]: 3 shared -> P = R = 3/4
    assert m.token_f1("The cat sat on the mat.", ["a cat on the mat today"]) == pytest.approx(0.75)
    # pred [paris, france] vs ref [paris]: P = 1/2, R = 1 -> 2/3; the second reference matches exactly
    assert m.token_f1("Paris, France", ["Paris"]) == pytest.approx(2 / 3)
    assert m.token_f1("Paris, France", ["Paris", "paris france"]) == pytest.approx(1.0)
    assert m.token_f1("one one two", ["1 2 2"]) == pytest.approx(2 / 3)  # counts are clipped: P = R = 2/3
    assert m.token_f1("berlin", ["paris"]) == 0.0
    assert m.token_f1("", ["paris"]) == 0.0


def test_rouge_l_hand_computed():
    # tokens [the cat sat on the mat] vs [the cat lay on a mat]: LCS = the cat on mat = 4 -> P = R = F = 4/6
    assert m.rouge_l("The cat sat on the mat.", ["the cat lay on a mat"]) == pytest.approx(2 / 3)
    # [a b c d] vs [a c]: LCS 2, P = 2/4, R = 2/2 -> F = 2/3; max over references takes the identical one
    assert m.rouge_l("a b c d", ["a c"]) == pytest.approx(2 / 3)
    assert m.rouge_l("a b c d", ["a c", "A B C D"]) == pytest.approx(1.0)
    assert m.rouge_l("", ["a c"]) == 0.0


def test_score_dispatch():
    assert tuple(m._SCORERS) == METRICS
    refs = ["dolores park"]
    pred = "Sit in Dolores Park."
    assert m.score("inclusion", pred, refs) == 1.0
    assert m.score("all", pred, refs) == 1.0
    assert m.score("exact", pred, refs) == 0.0
    assert m.score("f1", pred, refs) == pytest.approx(2 * (2 / 4) * 1 / (2 / 4 + 1))
    assert m.score("rouge", pred, refs) == pytest.approx(m.rouge_l(pred, refs))
    assert m.score("exact", "  \n", ["the"]) == 0.0  # blank prediction: 0 even though "the" normalises to ""
    with pytest.raises(ValueError, match="inclusion"):
        m.score("bleu", pred, refs)
    with pytest.raises(ValueError, match="references"):
        m.score("f1", pred, [])
    with pytest.raises(ValueError, match="references"):
        m.inclusion(pred, "dolores park")


def numpy_divergence(full, comp, valid):
    """Direct float64 computation, one position at a time."""
    kl, flip = np.zeros(full.shape[0]), np.zeros(full.shape[0])
    for b in range(full.shape[0]):
        ts = np.flatnonzero(valid[b])
        for t in ts:
            p = np.exp(full[b, t] - full[b, t].max())
            p /= p.sum()
            q = np.exp(comp[b, t] - comp[b, t].max())
            q /= q.sum()
            kl[b] += np.sum(p * np.log(p / q)) / len(ts)
            flip[b] += float(np.argmax(full[b, t]) != np.argmax(comp[b, t])) / len(ts)
    return kl, flip


@pytest.fixture
def logits():
    rng = np.random.default_rng(0)
    B, T, V = 4, 7, 33
    full = rng.normal(size=(B, T, V)) * 3
    comp = full + rng.normal(size=(B, T, V)) * np.array([0.0, 0.3, 1.0, 3.0])[:, None, None]
    valid = rng.random((B, T)) < 0.6
    valid[:, 0] = True
    valid[3, 5:] = False
    return full.astype(np.float32), comp.astype(np.float32), valid


def test_divergence_matches_numpy(logits):
    full, comp, valid = logits
    kl, flip = m.next_token_divergence(jnp.asarray(full), jnp.asarray(comp), jnp.asarray(valid))
    assert kl.shape == flip.shape == (4,) and kl.dtype == flip.dtype == jnp.float32
    want_kl, want_flip = numpy_divergence(full.astype(np.float64), comp.astype(np.float64), valid)
    np.testing.assert_allclose(kl, want_kl, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(flip, want_flip, atol=1e-6)
    assert want_flip[3] > 0 and want_kl[1] > 0  # the check is not vacuous


def test_divergence_identical_and_bf16(logits):
    full, _, valid = logits
    x = jnp.asarray(full, jnp.bfloat16)
    kl, flip = m.next_token_divergence(x, x, jnp.asarray(valid))
    np.testing.assert_array_equal(kl, 0.0)
    np.testing.assert_array_equal(flip, 0.0)


def test_divergence_all_invalid_row_is_zero(logits):
    full, comp, valid = logits
    valid = valid.copy()
    valid[2] = False
    full[2] = np.nan  # padding rows may hold anything
    kl, flip = m.next_token_divergence(jnp.asarray(full), jnp.asarray(comp), jnp.asarray(valid))
    assert kl[2] == 0.0 and flip[2] == 0.0
    assert np.all(np.isfinite(kl)) and np.all(np.isfinite(flip))


def test_divergence_masked_vocabulary_is_finite():
    full = jnp.array([[[0.0, 1.0, -jnp.inf]]])
    kl, flip = m.next_token_divergence(full, jnp.array([[[1.0, 0.0, -jnp.inf]]]), jnp.array([[True]]))
    p = np.exp([0.0, 1.0]) / np.exp([0.0, 1.0]).sum()
    np.testing.assert_allclose(kl, [np.sum(p * np.log(p / p[::-1]))], rtol=1e-5)
    assert flip[0] == 1.0


def test_divergence_jit_equals_eager(logits):
    args = tuple(jnp.asarray(a) for a in logits)
    eager = m.next_token_divergence(*args)
    jitted = jax.jit(m.next_token_divergence)(*args)
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_divergence_shape_errors(logits):
    full, comp, valid = (jnp.asarray(a) for a in logits)
    with pytest.raises(ValueError, match="logits"):
        m.next_token_divergence(full, comp[:, :-1], valid)
    with pytest.raises(ValueError, match="valid"):
        m.next_token_divergence(full, comp, valid[:, :-1])
