"""Trained scorers (kvzip_jax.scorers): the Fast KVzip gate against a float64 numpy oracle of its formula, its loss
and accuracy; the KVzap ridge fit against an independent closed form; gate training on a teacher gate's targets;
the learning-rate schedule; the scorer files (round trip, mismatches, atomic writes)."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from kvzip_jax.errors import KvzipError
from kvzip_jax.scorers import gate, linear, store, train

CFG = gate.GateConfig(layers=2, hidden=16, kv_heads=2, group=3, rank=4, sinks=5)


def _random_gates(cfg: gate.GateConfig, seed: int) -> dict[str, np.ndarray]:
    """float32 gates stacked over layers with every parameter away from its initial value."""
    rng = np.random.default_rng(seed)
    shapes = gate.param_shapes(cfg)
    normal = lambda name, std, mean=0.0: (mean + std * rng.standard_normal((cfg.layers, *shapes[name]))).astype(
        np.float32
    )
    return {
        "q_w": normal("q_w", 1 / np.sqrt(cfg.hidden)),
        "q_b": normal("q_b", 0.3),
        "k_w": normal("k_w", 1 / np.sqrt(cfg.hidden)),
        "q_norm": normal("q_norm", 0.3, 1.0),
        "k_norm": normal("k_norm", 0.3, 1.0),
        "k_base": normal("k_base", 1.0),
        "b": normal("b", 0.7),
    }


def _layer(params: dict, layer: int) -> dict:
    return {name: value[layer] for name, value in params.items()}


def _oracle_scores(p: dict, cfg: gate.GateConfig, hidden: np.ndarray) -> np.ndarray:
    """The gate's formula in float64 numpy: hidden [T, D] -> scores [H, T]."""
    p = {name: np.asarray(value, np.float64) for name, value in p.items()}
    h = np.asarray(hidden, np.float64)
    T, H, G, R = h.shape[0], cfg.kv_heads, cfg.group, cfg.rank
    rms = lambda x, w: w * x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + cfg.eps)
    q = rms((h @ p["q_w"] + p["q_b"]).reshape(T, H, G, R), p["q_norm"])
    k = rms((h @ p["k_w"]).reshape(T, H, R), p["k_norm"])
    logit = np.einsum("thr,thgr->thg", k, q) / np.sqrt(R) + p["b"]
    base = np.einsum("hsr,thgr->thgs", p["k_base"], q) / np.sqrt(R)
    prob = np.exp(logit) / (np.exp(logit) + np.exp(base).sum(-1))
    return prob.mean(-1).T


def _oracle_loss(params: dict, cfg: gate.GateConfig, hidden: np.ndarray, targets: np.ndarray) -> float:
    total = 0.0
    for layer in range(cfg.layers):
        p = np.clip(_oracle_scores(_layer(params, layer), cfg, hidden[layer]).T, 1e-7, 1 - 1e-7)  # [N, H]
        y = targets[layer].astype(np.float64)
        total += np.sum(np.mean(-y * np.log(p) - (1 - y) * np.log(1 - p), axis=0))
    return total


def test_gate_config_rejects_non_positive_sizes():
    for bad in ({"layers": 0}, {"hidden": -1}, {"kv_heads": 0}, {"group": 0}, {"rank": 0}, {"sinks": 0}):
        with pytest.raises(ValueError):
            gate.GateConfig(**{"layers": 1, "hidden": 4, "kv_heads": 1, "group": 1, **bad})
    with pytest.raises(ValueError):
        gate.GateConfig(1, 4, 1, 1, eps=0.0)


def test_init_gates_shapes_and_values():
    params = gate.init_gates(CFG, jax.random.key(0))
    for name, shape in gate.param_shapes(CFG).items():
        assert params[name].shape == (CFG.layers, *shape) and params[name].dtype == jnp.float32
    assert np.all(params["q_norm"] == 1) and np.all(params["k_norm"] == 1)
    assert np.all(params["k_base"] == 0) and np.all(params["b"] == 0) and np.all(params["q_b"] == 0)
    assert 0.5 < np.std(np.asarray(params["q_w"])) * np.sqrt(CFG.hidden) < 1.5


def test_gate_scores_match_numpy_oracle():
    params = _random_gates(CFG, 0)
    hidden = np.random.default_rng(1).standard_normal((2, 7, CFG.hidden)).astype(np.float32)  # [batch, T, D]
    for layer in range(CFG.layers):
        p = _layer(params, layer)
        scores = np.asarray(gate.gate_scores(p, CFG, hidden))
        assert scores.shape == (2, CFG.kv_heads, 7)
        for row in range(2):
            np.testing.assert_allclose(scores[row], _oracle_scores(p, CFG, hidden[row]), atol=1e-5, rtol=0)
        assert np.all((scores > 0) & (scores < 1))


def test_gate_logit_is_own_logit_minus_sink_logsumexp_on_one_token():
    p = _layer(_random_gates(CFG, 2), 0)
    h = np.random.default_rng(3).standard_normal((1, CFG.hidden))  # [T=1, D]
    H, G, R = CFG.kv_heads, CFG.group, CFG.rank
    rms = lambda x, w: w * x / np.sqrt(np.mean(x**2) + CFG.eps)
    qs = (h[0] @ p["q_w"] + p["q_b"]).reshape(H, G, R)
    ks = (h[0] @ p["k_w"]).reshape(H, R)
    z = np.asarray(gate.gate_logits(p, CFG, h.astype(np.float32)))[0]  # [H, G]
    for head in range(H):
        k = rms(ks[head], p["k_norm"])
        for g in range(G):
            q = rms(qs[head, g], p["q_norm"])
            own = k @ q / np.sqrt(R) + p["b"][head, g]
            sinks = p["k_base"][head] @ q / np.sqrt(R)
            expected = own - np.log(np.sum(np.exp(sinks)))
            np.testing.assert_allclose(z[head, g], expected, atol=1e-5)
    # no learned sinks (k_base = 0): S equal sink logits of 0, so z = own logit - log S
    flat = {**p, "k_base": np.zeros_like(p["k_base"])}
    z0 = np.asarray(gate.gate_logits(flat, CFG, h.astype(np.float32)))[0]
    k = rms(ks[1], p["k_norm"])
    q = rms(qs[1, 2], p["q_norm"])
    np.testing.assert_allclose(z0[1, 2], k @ q / np.sqrt(R) + p["b"][1, 2] - np.log(CFG.sinks), atol=1e-5)


def test_gate_jit_equals_eager():
    p = _layer(_random_gates(CFG, 4), 1)
    hidden = jnp.asarray(np.random.default_rng(5).standard_normal((9, CFG.hidden)), jnp.float32)
    eager = gate.gate_scores(p, CFG, hidden)
    jitted = jax.jit(gate.gate_scores)(p, CFG, hidden)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), atol=1e-6, rtol=0)


def test_gate_loss_and_accuracy_match_numpy():
    params = _random_gates(CFG, 6)
    rng = np.random.default_rng(7)
    hidden = rng.standard_normal((CFG.layers, 11, CFG.hidden)).astype(np.float32)  # [L, N, D]
    targets = rng.uniform(0, 0.2, (CFG.layers, 11, CFG.kv_heads)).astype(np.float32)  # [L, N, H]
    loss = float(jax.jit(gate.gate_loss)(params, CFG, hidden, targets))
    np.testing.assert_allclose(loss, _oracle_loss(params, CFG, hidden, targets), rtol=1e-5)
    pred = np.stack([_oracle_scores(_layer(params, layer), CFG, hidden[layer]).T for layer in range(CFG.layers)])
    expected_acc = np.mean((pred >= 0.05) == (targets >= 0.05))
    np.testing.assert_allclose(
        float(jax.jit(gate.gate_accuracy)(params, CFG, hidden, targets)), expected_acc, atol=1e-6
    )
    # the loss stays finite where the gate saturates (log-space, no clipping needed)
    saturated = {**params, "b": params["b"] + 60.0}
    loss, grads = jax.jit(jax.value_and_grad(gate.gate_loss))(saturated, CFG, hidden, targets)
    assert np.isfinite(float(loss))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))


def test_ridge_matches_an_independent_closed_form(monkeypatch):
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((50, 6)) * [1, 2, 0.5, 3, 1, 1] + 2.0).astype(np.float32)  # [N, D], not centred
    y = (x @ rng.standard_normal((6, 3)) + rng.standard_normal((50, 3)) + 5.0).astype(np.float32)  # [N, H]
    monkeypatch.setattr(linear, "CHUNK", 7)  # several chunks of the normal equations
    fit = linear.fit_ridge(x, y, alpha=2.5)
    # scikit-learn's Ridge with an intercept: centred least squares with sqrt(alpha) I rows appended
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    xc, yc = x64 - x64.mean(0), y64 - y64.mean(0)
    stacked_x = np.concatenate([xc, np.sqrt(2.5) * np.eye(6)])
    stacked_y = np.concatenate([yc, np.zeros((6, 3))])
    w = np.linalg.lstsq(stacked_x, stacked_y, rcond=None)[0]
    b = y64.mean(0) - x64.mean(0) @ w
    assert fit["w"].shape == (6, 3) and fit["b"].shape == (3,) and fit["w"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(fit["w"]), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(fit["b"]), b, rtol=1e-5, atol=1e-5)


def test_ridge_recovers_noiseless_linear_weights():
    rng = np.random.default_rng(9)
    w_true, b_true = rng.standard_normal((5, 2)), rng.standard_normal(2)
    x = rng.standard_normal((200, 5)).astype(np.float32)
    y = (x.astype(np.float64) @ w_true + b_true).astype(np.float32)
    fit = linear.fit_ridge(x, y, alpha=1e-8)
    np.testing.assert_allclose(np.asarray(fit["w"]), w_true, atol=1e-4)
    np.testing.assert_allclose(np.asarray(fit["b"]), b_true, atol=1e-4)


def test_linear_scorers_stack_score_and_loss():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((3, 40, 8)).astype(np.float32)  # [L, N, D]
    y = rng.standard_normal((3, 40, 2)).astype(np.float32)  # [L, N, H]
    params = linear.fit_linear_scorers(x, y, alpha=1.0)
    assert params["w"].shape == (3, 8, 2) and params["b"].shape == (3, 2)
    one = linear.fit_ridge(x[1], y[1], alpha=1.0)
    np.testing.assert_array_equal(np.asarray(params["w"][1]), np.asarray(one["w"]))
    scores = linear.linear_scores({"w": params["w"][1], "b": params["b"][1]}, x[1][None])  # [1, H, T]
    assert scores.shape == (1, 2, 40)
    expected = x[1].astype(np.float64) @ np.asarray(params["w"][1]) + np.asarray(params["b"][1])  # [N, H]
    np.testing.assert_allclose(np.asarray(scores[0]).T, expected, atol=1e-5)
    pred = np.einsum("lnd,ldh->lnh", x.astype(np.float64), np.asarray(params["w"])) + np.asarray(params["b"])[:, None]
    np.testing.assert_allclose(float(linear.linear_loss(params, x, y)), np.mean((pred - y) ** 2), rtol=1e-5)


def test_schedule_multipliers_at_the_boundaries():
    schedule = train.learning_rate_schedule(5000)
    multiplier = lambda step: float(schedule(step)) / train.BASE_LR
    for step, expected in [(0, 0.0), (1, 0.01), (25, 0.25), (49, 0.49), (50, 1.0), (2499, 1.0), (2500, 0.5)]:
        assert multiplier(step) == pytest.approx(expected, abs=1e-6), step
    for step, expected in [(3749, 0.5), (3750, 0.25), (4999, 0.25)]:
        assert multiplier(step) == pytest.approx(expected, abs=1e-6), step
    assert train.schedule_boundaries(300) == (3, 150, 225)
    short = train.learning_rate_schedule(300)
    assert [float(short(s)) / train.BASE_LR for s in (0, 2, 3, 149, 150, 224, 225)] == pytest.approx(
        [0.0, 1 / 3, 1.0, 1.0, 0.5, 0.5, 0.25]
    )


def test_training_on_a_teacher_gate_lowers_the_held_out_loss():
    cfg = gate.GateConfig(layers=2, hidden=16, kv_heads=2, group=2, rank=4, sinks=4)
    teacher = _random_gates(cfg, 11)
    teacher["b"] = teacher["b"] - 2.0  # mostly low scores, as KVzip's
    rng = np.random.default_rng(12)
    x = rng.standard_normal((cfg.layers, 2500, cfg.hidden)).astype(np.float32)  # [L, N, D]
    scores = jax.vmap(gate.gate_scores, in_axes=(0, None, 0))(teacher, cfg, x)  # [L, H, N]
    y = np.asarray(jnp.swapaxes(scores, -1, -2))  # [L, N, H]
    calls = []
    params, history = train.train_gates(
        cfg, x[:, :2000], y[:, :2000], x[:, 2000:], y[:, 2000:], steps=300, batch=200, eval_every=100,
        progress=lambda step, total: calls.append((step, total)),
    )  # fmt: skip
    assert [entry["step"] for entry in history] == [0, 100, 200, 300]
    assert calls[0] == (1, 300) and calls[-1] == (300, 300) and len(calls) == 300
    assert set(history[0]) == {"step", "train_loss", "val_loss", "val_acc"}
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, gate.init_gates(cfg, jax.random.key(0)))
    # BCE against soft targets bottoms out at their entropy: compare the excess over it
    yv = y[:, 2000:].astype(np.float64)
    floor = np.sum(np.mean(-yv * np.log(yv) - (1 - yv) * np.log(1 - yv), axis=1))
    start, end = history[0]["val_loss"] - floor, history[-1]["val_loss"] - floor
    assert end < 0.2 * start, (start, end, history)
    assert history[-1]["val_acc"] > history[0]["val_acc"]
    assert history[-1]["val_loss"] == pytest.approx(train.evaluate_gates(params, cfg, x[:, 2000:], y[:, 2000:])[0])


def _manifest(**extra) -> dict:
    return {"model": "tiny-model", "model_config": "abc123", "tokens": np.int64(2000), "val_loss": 0.25, **extra}


def test_save_and_load_round_trip(tmp_path):
    params = _random_gates(CFG, 13)
    path = store.save_scorer(tmp_path / "gates", "gate", params, _manifest(), config=CFG)
    kind, loaded, manifest = store.load_scorer(path, model="tiny-model", model_config="abc123")
    assert kind == "gate" and set(loaded) == set(params)
    for name in params:
        np.testing.assert_array_equal(np.asarray(loaded[name]), params[name])
        assert loaded[name].dtype == jnp.float32
    assert manifest["config"] == dataclasses.asdict(CFG)
    assert gate.GateConfig(**manifest["config"]) == CFG
    assert manifest["tokens"] == 2000 and manifest["val_loss"] == 0.25 and manifest["model"] == "tiny-model"
    assert json.loads((path / store.MANIFEST).read_text()) == manifest
    lin = {"w": np.ones((2, 4, 3), np.float32), "b": np.zeros((2, 3), np.float32)}
    store.save_scorer(tmp_path / "linear", "linear", lin, _manifest())
    kind, loaded, manifest = store.load_scorer(tmp_path / "linear")
    assert kind == "linear" and manifest["config"] == {"layers": 2, "hidden": 4, "kv_heads": 3}
    np.testing.assert_array_equal(np.asarray(loaded["w"]), lin["w"])


def test_load_refuses_another_model_or_a_missing_folder(tmp_path):
    path = store.save_scorer(tmp_path / "gates", "gate", _random_gates(CFG, 14), _manifest())
    with pytest.raises(store.ScorerMismatchError, match="tiny-model.*other-model"):
        store.load_scorer(path, model="other-model")
    with pytest.raises(store.ScorerMismatchError, match="abc123.*def456"):
        store.load_scorer(path, model="tiny-model", model_config="def456")
    with pytest.raises(store.ScorerMismatchError, match="no trained scorer"):
        store.load_scorer(tmp_path / "absent", model="tiny-model")
    (path / store.MANIFEST).write_text("{not json")
    with pytest.raises(store.ScorerMismatchError):
        store.load_scorer(path)
    assert issubclass(store.ScorerMismatchError, KvzipError) and issubclass(store.ScorerMismatchError, ValueError)


def test_save_refuses_an_existing_directory_unless_overwrite(tmp_path):
    params = _random_gates(CFG, 15)
    path = store.save_scorer(tmp_path / "gates", "gate", params, _manifest())
    with pytest.raises(store.ScorerFileError, match="already exists"):
        store.save_scorer(path, "gate", params, _manifest())
    store.save_scorer(path, "gate", params, _manifest(model_config="new"), overwrite=True)
    assert store.load_scorer(path, model_config="new")[2]["model_config"] == "new"
    assert os.listdir(tmp_path) == ["gates"]
    with pytest.raises(ValueError, match="model_config"):
        store.save_scorer(tmp_path / "other", "gate", params, {"model": "m"})
    with pytest.raises(ValueError, match="does not match"):
        store.save_scorer(tmp_path / "other", "gate", params, _manifest(), config=gate.GateConfig(2, 16, 2, 2, 4, 5))


def test_a_failed_save_leaves_no_directory(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        store.save_scorer(tmp_path / "gates", "gate", _random_gates(CFG, 16), _manifest())
    assert os.listdir(tmp_path) == []
