"""Attention Matching's closed-form fit of one KV head (arXiv 2602.16284, reference/attention_matching.md §1-3).

Given reference queries Q [n, H] (post-RoPE, unscaled), the block's keys and values K, V [T, H] and t selected keys
S, it returns the compacted block (C_k = K[S], beta [t], C_v [t, H]) whose attention output and attention mass
match the block's for those queries:

  mass:   sum_j exp(s q.C_k,j + beta_j) ~= sum_j exp(s q.K_j)   (beta = log w, w from box-constrained NNLS)
  output: softmax(s q C_k^T + beta) C_v ~= softmax(s q K^T) V   (C_v by least squares)

Matching both preserves the block under concatenation with any later keys (the mixture identity, `mixture`). All
arithmetic is float32; rows are shifted by their max logit r_i, as the reference code does, so the mass fit is a
least squares weighted by exp(-2 r_i) per query. Queries that see no valid key carry no weight.

Einsum legend: N reference queries, T block keys, S selected keys (t), H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.models.attention import MASK_VALUE

HIGHEST = jax.lax.Precision.HIGHEST
GRAM_BLOCK = 128  # columns per block of a Gram computed only as far as a head's count
RIDGE = 1e-6  # relative ridge of the normal equations (x mean diagonal): keeps a rank-deficient fit finite
REFINE_STEPS = 2  # corrections after a normal-equations solve (`_solve_normal`): float32 then matches a QR solve


def logits(
    q: jax.Array,
    k: jax.Array,
    scale: float,
    key_valid: jax.Array | None = None,
    query_valid: jax.Array | None = None,
    key_bias: jax.Array | None = None,
) -> jax.Array:
    """[N, T] float32 scaled logits s q.k (+ key_bias [T], the bias a block compacted before carries), MASK_VALUE
    where key_valid [T] or query_valid [N] is False (a row of a padding query sees no key, so it carries no weight in
    any fit)."""
    z = jnp.einsum("NH,TH->NT", q.astype(jnp.float32), k.astype(jnp.float32), precision=HIGHEST) * scale
    if key_bias is not None:
        z = z + key_bias.astype(jnp.float32)[None, :]
    if key_valid is not None:
        z = jnp.where(key_valid[None, :], z, MASK_VALUE)
    return z if query_valid is None else jnp.where(query_valid[:, None], z, MASK_VALUE)


def mass_features(z: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(Phi [N, T], m [N], seen [N]) from logits z [N, T]: Phi = exp(z - r) with r the row max, m its row sums (the
    row-shifted target mass), seen whether a row has any valid key (rows that do not are zero)."""
    r = z.max(axis=1)  # [N]
    seen = r > MASK_VALUE / 2  # [N]
    phi = jnp.where(seen[:, None] & (z > MASK_VALUE / 2), jnp.exp(z - jnp.where(seen, r, 0.0)[:, None]), 0.0)
    return phi, phi.sum(axis=1), seen


def gram(a: jax.Array, columns: jax.Array | None = None) -> jax.Array:
    """a^T a [S, S] for a [N, S]. columns (a traced int, or None: all): a's columns from `columns` on are zero (a
    padded fit's inactive keys), so only the blocks of GRAM_BLOCK x GRAM_BLOCK columns before it are computed: the
    work follows a head's own count, not the static size of its fit (the Gram is most of a fit's work)."""
    S = a.shape[1]
    if columns is None or S <= GRAM_BLOCK:
        return jnp.einsum("NS,NU->SU", a, a, precision=HIGHEST)
    blocks = -(-S // GRAM_BLOCK)
    rows = jnp.pad(a, ((0, 0), (0, blocks * GRAM_BLOCK - S))).T  # [S', N]: a column block is a contiguous row slice
    take = lambda i: jax.lax.dynamic_slice_in_dim(rows, i * GRAM_BLOCK, GRAM_BLOCK)  # [GRAM_BLOCK, N]

    def block_row(i, g):
        left = take(i)

        def block(j, g):  # the (i, j) block and its mirror
            b = jnp.einsum("SN,UN->SU", left, take(j), precision=HIGHEST)  # [GRAM_BLOCK, GRAM_BLOCK]
            g = jax.lax.dynamic_update_slice(g, b, (i * GRAM_BLOCK, j * GRAM_BLOCK))
            return jax.lax.dynamic_update_slice(g, b.T, (j * GRAM_BLOCK, i * GRAM_BLOCK))

        return jax.lax.fori_loop(0, i + 1, block, g)

    used = (jnp.clip(columns, 0, S) + GRAM_BLOCK - 1) // GRAM_BLOCK
    g = jax.lax.fori_loop(0, used, block_row, jnp.zeros((blocks * GRAM_BLOCK,) * 2, a.dtype))
    return g[:S, :S]


def _solve_normal(
    a: jax.Array,
    b: jax.Array,
    ridge: float = RIDGE,
    prior: jax.Array | None = None,
    gram_a: jax.Array | None = None,
    columns: jax.Array | None = None,
) -> jax.Array:
    """argmin_x |a x - b|^2 + lam |x - prior|^2 via Cholesky of a^T a + lam I: a [N, S], b [N, ...] -> [S, ...];
    lam = ridge x the mean diagonal of a^T a over the columns in use (relative, so it does not depend on the scale
    of a; all-zero columns, a padded fit's inactive keys, do not count, so padding does not change the fit); prior: 0
    if None; gram_a: a^T a when already computed; columns: as in `gram`.

    The normal equations square a's condition number, which float32 does not survive (cond(a) ~ 1e3 already leaves
    errors of 10% in x), so REFINE_STEPS corrections x += (a^T a + lam I)^-1 g follow, each with the gradient g taken
    through a itself, g = a^T (b - a x) + lam (prior - x) (corrected semi-normal equations): they bring x to a QR
    solve's accuracy while the work stays one Gram."""
    gram_a = gram(a, columns) if gram_a is None else gram_a
    size = gram_a.shape[0]
    diagonal = jnp.diagonal(gram_a)  # [S]
    used = jnp.maximum(jnp.sum(diagonal > 0), 1)
    lam = ridge * jnp.maximum(jnp.sum(diagonal) / used, 1e-30)
    chol = jnp.linalg.cholesky(gram_a + lam * jnp.eye(size, dtype=gram_a.dtype))
    prior = jnp.zeros((size,) + b.shape[1:], gram_a.dtype) if prior is None else prior

    def gradient(x):  # [S, ...]: a^T (b - a x) + lam (prior - x), through a rather than its Gram
        residual = b - jnp.einsum("NS,S...->N...", a, x, precision=HIGHEST)
        return jnp.einsum("NS,N...->S...", a, residual, precision=HIGHEST) + lam * (prior - x)

    x = prior
    for _ in range(1 + REFINE_STEPS):  # the solve from the prior, then its corrections
        x = x + jax.scipy.linalg.cho_solve((chol, True), gradient(x))
    return x


def nnls_box(
    m: jax.Array, y: jax.Array, lower: float, upper: float, iters: int, columns: jax.Array | None = None
) -> jax.Array:
    """w [S] ~ argmin_{lower <= w <= upper} |m w - y|^2 for m [N, S], y [N]: the (ridged) least-squares solution
    clipped to the box, then `iters` projected-gradient steps of size 1/|m^T m|_F (the Frobenius norm bounds the
    largest eigenvalue, so the steps never overshoot, at the price of an eigensolver; with enough steps it converges
    to the box-NNLS optimum, whose KKT conditions tests/test_matching.py checks). columns: as in `gram`."""
    gram_m = gram(m, columns)  # [S, S], shared with the least-squares start
    w = jnp.clip(_solve_normal(m, y, gram_a=gram_m), lower, upper)  # [S]
    if iters == 0:
        return w
    lipschitz = jnp.maximum(jnp.sqrt(jnp.sum(gram_m * gram_m)), 1e-6)  # >= |m|_2^2
    target = jnp.einsum("NS,N->S", m, y, precision=HIGHEST)  # [S]

    def step(_, w):
        return jnp.clip(w - (jnp.einsum("SU,U->S", gram_m, w, precision=HIGHEST) - target) / lipschitz, lower, upper)

    return jax.lax.fori_loop(0, iters, step, w)


def fit_head(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    selected: jax.Array,
    scale: float,
    key_valid: jax.Array | None = None,
    *,
    query_valid: jax.Array | None = None,
    active: jax.Array | None = None,
    lower: float = float(np.exp(np.float32(-3.0))),
    upper: float = float(np.exp(np.float32(3.0))),
    iters: int = 2,
    value_ridge: float = RIDGE,
    key_bias: jax.Array | None = None,
    fit_values: bool = True,
):
    """The compacted block of one KV head: (C_k [S, H], beta [S], C_v [S, H]), float32.

    q [N, H] reference queries (query_valid [N] bool: padding rows carry no weight); k, v [T, H]; selected [S] int
    indices into T (S static; S = 0 gives empty arrays); key_valid [T] bool or None; active [S] bool or None: only
    the active selected keys take part (a budget below the static S; the others come back as zeros with beta =
    log(lower), to be dropped). beta = log w with w from nnls_box over the mass features (box [lower, upper]; the
    defaults are the paper's HAK setting e^-3..e^3 with 2 gradient steps); C_v is the least-squares fit of the
    block's outputs from the compacted attention weights. key_bias [T]: the block's own per-key bias (a block
    compacted before, compacted again); the returned beta then includes it (beta = key_bias[S] + log w).
    fit_values False: C_v is the kept values themselves (only beta fitted; MLA, where a slot's latent is its key too).
    """
    if selected.shape[0] == 0:  # a head whose budget is 0 keeps nothing
        return (
            jnp.zeros((0, k.shape[1]), jnp.float32),
            jnp.zeros((0,), jnp.float32),
            jnp.zeros((0, v.shape[1]), jnp.float32),
        )
    active = jnp.ones(selected.shape, bool) if active is None else active
    columns = jnp.max(jnp.where(active, jnp.arange(1, active.shape[0] + 1), 0))  # inactive from here on
    z = logits(q, k, scale, key_valid, query_valid, key_bias)  # [N, T]
    phi, mass, seen = mass_features(z)
    w = nnls_box(jnp.where(active[None, :], phi[:, selected], 0.0), mass, lower, upper, iters, columns)  # [S]
    beta = jnp.log(w)
    kept_v = jnp.where(active[:, None], v[selected].astype(jnp.float32), 0.0)  # [S, H]
    kept_beta = beta if key_bias is None else beta + key_bias[selected].astype(jnp.float32)
    if not fit_values:
        return k[selected].astype(jnp.float32), kept_beta, kept_v
    attention = phi / jnp.where(seen, mass, 1.0)[:, None]  # [N, T]: softmax(z) from its shifted exps; unseen rows 0
    target = jnp.einsum("NT,TH->NH", attention, v.astype(jnp.float32), precision=HIGHEST)  # [N, H]
    compact_z = jnp.where(active[None, :], z[:, selected] + beta[None, :], MASK_VALUE)  # [N, S]
    weights = jnp.where(seen[:, None] & active[None, :], jax.nn.softmax(compact_z, axis=1), 0.0)  # [N, S]
    c_v = _solve_normal(weights, target, value_ridge, kept_v, columns=columns)  # [S, H]; towards the kept values
    return k[selected].astype(jnp.float32), kept_beta, c_v


def attend(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, bias: jax.Array | None = None):
    """(out [N, H], lse [N]) of softmax attention of q [N, H] over k, v [T, H] with an additive per-key bias [T]."""
    z = logits(q, k, scale)
    if bias is not None:
        z = z + bias[None, :]
    lse = jax.nn.logsumexp(z, axis=1)  # [N]
    return jnp.einsum("NT,TH->NH", jnp.exp(z - lse[:, None]), v.astype(jnp.float32), precision=HIGHEST), lse


def mixture(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """Attention over [A | B] from each block's (out [N, H], lse [N]): the mass-weighted mixture (App. A.2)."""
    lse = jnp.logaddexp(lse_a, lse_b)  # [N]
    return jnp.exp(lse_a - lse)[:, None] * out_a + jnp.exp(lse_b - lse)[:, None] * out_b
