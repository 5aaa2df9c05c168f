"""Training of the Fast KVzip gates (gate.py) on (hidden state, KVzip score) pairs: optax SGD with momentum 0.9 at a
base learning rate of 0.2, no weight decay, over random batches of tokens (the same token indices in every layer),
reshuffled each epoch.

Learning-rate multiplier over `steps` (5000 by default; the boundaries are fractions of it, so 50, 2500, 3750 at
5000): 0.5 * step / w below w = 1% (0.01 * step at 5000 steps), 1.0 until 50%, 0.5 until 75%, 0.25 after.

Einsum legend: L layers, N tokens, D model width, H KV heads.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvzip_jax.scorers.gate import GateConfig, gate_accuracy, gate_loss, init_gates

BASE_LR = 0.2
MOMENTUM = 0.9
WARMUP, HALF, THREE_QUARTERS = 0.01, 0.5, 0.75  # the schedule's boundaries as fractions of the step count
EVAL_EVERY = 500  # steps between history entries
EVAL_CHUNK = 4096  # held-out tokens per evaluation call


def schedule_boundaries(steps: int) -> tuple[int, int, int]:
    """(end of warm-up, start of x0.5, start of x0.25) for a run of `steps` steps: 50, 2500, 3750 at 5000."""
    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    return tuple(int(round(fraction * steps)) for fraction in (WARMUP, HALF, THREE_QUARTERS))


def learning_rate_schedule(steps: int, base: float = BASE_LR) -> optax.Schedule:
    """The learning rate at each optimizer step (count from 0): base times a multiplier rising linearly from 0 by
    0.5 / warm-up per step during the warm-up, then 1.0, 0.5 from half the steps, 0.25 from three quarters."""
    warmup, half, three_quarters = schedule_boundaries(steps)
    after = optax.piecewise_constant_schedule(base, {half - warmup: 0.5, three_quarters - warmup: 0.5})
    if warmup == 0:
        return after
    rising = optax.linear_schedule(0.0, 0.5 * base, warmup)
    return optax.join_schedules([rising, after], [warmup])


def _check_data(cfg: GateConfig, x, y, name: str) -> None:
    L, D, H = cfg.layers, cfg.hidden, cfg.kv_heads
    if np.ndim(x) != 3 or np.ndim(y) != 3 or np.shape(x)[:2] != np.shape(y)[:2]:
        raise ValueError(f"{name}: need hidden [L, N, D] and targets [L, N, H], got {np.shape(x)} and {np.shape(y)}")
    if np.shape(x)[0] != L or np.shape(x)[2] != D or np.shape(y)[2] != H:
        raise ValueError(f"{name}: shapes {np.shape(x)} and {np.shape(y)} do not match L={L}, D={D}, H={H}")
    if np.shape(x)[1] == 0:
        raise ValueError(f"{name}: no tokens")


def _batches(n: int, batch: int, seed: int):
    """Endless token indices [batch] (int32): each epoch a fresh permutation of range(n), cut into whole batches."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(n).astype(np.int32)
        for start in range(0, n - batch + 1, batch):
            yield order[start : start + batch]


def evaluate_gates(params: dict, cfg: GateConfig, x, y, chunk: int = EVAL_CHUNK) -> tuple[float, float]:
    """(gate_loss, gate_accuracy) over all tokens of x [L, N, D], y [L, N, H], computed `chunk` tokens at a time."""
    n = np.shape(x)[1]
    loss = acc = 0.0
    for start in range(0, n, chunk):
        xc, yc = jnp.asarray(x[:, start : start + chunk]), jnp.asarray(y[:, start : start + chunk])
        size = xc.shape[1]
        chunk_loss, chunk_acc = _evaluate(params, cfg, xc, yc)
        loss += float(chunk_loss) * size  # the loss is a sum over heads of means over tokens: weight by tokens
        acc += float(chunk_acc) * size
    return loss / n, acc / n


@jax.jit
def _evaluate(params: dict, cfg: GateConfig, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    return gate_loss(params, cfg, x, y), gate_accuracy(params, cfg, x, y)


def train_gates(
    cfg: GateConfig,
    x_train,
    y_train,
    x_val,
    y_val,
    steps: int = 5000,
    batch: int = 1000,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    eval_every: int = EVAL_EVERY,
) -> tuple[dict, list[dict]]:
    """Gates of every layer trained on x_train [L, N, D] (hidden states) against y_train [L, N, H] (KVzip scores in
    [0, 1]); x_val [L, M, D], y_val [L, M, H] held out. Returns (params stacked over L, history): history holds
    {step, train_loss, val_loss, val_acc} at step 0, every eval_every steps and at the end; train_loss is the mean
    batch loss of the steps since the previous entry (at step 0: the first batch's). progress(step, total) is
    called on the host after each step."""
    _check_data(cfg, x_train, y_train, "training data")
    _check_data(cfg, x_val, y_val, "held-out data")
    if batch < 1 or eval_every < 1:
        raise ValueError(f"batch and eval_every must be positive, got {batch} and {eval_every}")
    n = np.shape(x_train)[1]
    batch = min(batch, n)
    optimizer = optax.sgd(learning_rate_schedule(steps), momentum=MOMENTUM)
    params = init_gates(cfg, jax.random.key(seed))
    opt_state = optimizer.init(params)
    x_train = jnp.asarray(x_train, jnp.float32)  # [L, N, D]
    y_train = jnp.asarray(y_train, jnp.float32)  # [L, N, H]

    @jax.jit
    def step_fn(params, opt_state, x, y, idx):
        loss, grads = jax.value_and_grad(gate_loss)(params, cfg, x[:, idx], y[:, idx])
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batches = _batches(n, batch, seed)
    first = next(batches)
    start_loss = _evaluate(params, cfg, x_train[:, first], y_train[:, first])[0]
    val_loss, val_acc = evaluate_gates(params, cfg, x_val, y_val)
    history = [{"step": 0, "train_loss": float(start_loss), "val_loss": val_loss, "val_acc": val_acc}]
    losses, idx = [], first
    for step in range(1, steps + 1):
        params, opt_state, loss = step_fn(params, opt_state, x_train, y_train, idx)
        losses.append(loss)
        idx = next(batches)
        if step % eval_every == 0 or step == steps:
            val_loss, val_acc = evaluate_gates(params, cfg, x_val, y_val)
            train_loss = float(jnp.mean(jnp.stack(losses)))
            history.append({"step": step, "train_loss": train_loss, "val_loss": val_loss, "val_acc": val_acc})
            losses = []
        if progress is not None:
            progress(step, steps)
    return params, history
