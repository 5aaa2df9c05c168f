"""How far Attention Matching's closed form is from a local optimum, and at what cost (issue 16 item 3).

    python studies/matching_refine/matching_refine.py [--model smollm2-135m-instruct] [--tokens 600] [--ratio 0.1]
                                                      [--steps 300]

One generated passkey context on a real model, KVzip's reread as reference queries (the repeat source) and, held out,
the queries of the task's questions followed by the full cache's answers. For every (layer, KV head): HAK keeps
ratio x T keys, the closed form fits beta and C_v (matching.fit_head), then Adam refines them for --steps steps
(matching.refine_head) on the reference queries. Prints, averaged over heads, the matching objective (relative output
error + squared lse error) of eviction (the kept pairs as they are), of the closed form and of the refined fit, on
the reference queries and on the held-out ones, and the seconds of the closed form and of the refinement (all heads,
jitted, compile excluded), side by side in one run.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import generate as gen
from kvzip_jax import kvzip, matching, prompts
from kvzip_jax.eval import tasks
from kvzip_jax.weights import registry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=registry.SMOLLM2)
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)

    model = registry.load(args.model, dtype="float32")
    cfg, params, tok = model.cfg, model.params, model.tokenizer
    ex = tasks.generate("passkey", 1, 0, args.tokens)[0]
    ctx, suffixes = prompts.split_for_reuse(tok, ex.context, list(ex.questions), instruction=prompts.KVZIP_INSTRUCTION)
    _, cache = gen.prefill(params, cfg, [ctx.ids()], capacity=ctx.ids().shape[0] + 256)
    reread = kvzip.reread_inputs(tok, [ctx.context_start], [ctx.ids()[ctx.context_slice]])
    refs = matching.reference_queries(params, cfg, cache, reread, ("repeat",), 8192)
    turns = []
    for suffix in suffixes:  # held out: each question followed by the full cache's answer
        answer, cache = gen.ask(params, cfg, cache, suffix, 24, stop_tokens=prompts.stop_token_ids(tok))
        turns.append(np.concatenate([suffix, np.asarray(answer, np.int32)]))
    width = max(map(len, turns))
    tokens = np.zeros((len(turns), 1, width), np.int32)
    for i, t in enumerate(turns):
        tokens[i, 0, : len(t)] = t
    held = matching.reference_queries(
        params,
        cfg,
        cache,
        reread,
        ("self-study",),
        100000,
        probes=matching.Probes(jnp.asarray(tokens), jnp.asarray([[len(t)] for t in turns], np.int32)),
    )
    pre, n = int(reread.prefix_len[0]), int(reread.context_len[0])
    t = max(1, int(args.ratio * n))
    scale = cfg.query_scale

    def per_head(q, qv, k, v):
        selected = jnp.sort(jax.lax.top_k(matching.attention_key_scores(q, k, scale, query_valid=qv), t)[1])
        ck, beta, cv = matching.fit_head(q, k, v, selected, scale, query_valid=qv)
        return selected, ck, beta, cv

    def refine(q, qv, k, v, ck, beta, cv):
        return matching.refine_head(q, k, v, ck, beta, cv, scale, query_valid=qv, steps=args.steps)[1:3]

    heads = [(layer, h) for layer in range(cfg.num_layers) for h in range(cfg.num_kv_heads)]
    q = jnp.stack([refs.q[layer][0, h] for layer, h in heads])  # [heads, R, H]
    qh = jnp.stack([held.q[layer][0, h] for layer, h in heads])
    k = jnp.stack([cache.layers[layer].k[0, h, pre : pre + n] for layer, h in heads])  # [heads, T, H]
    v = jnp.stack([cache.layers[layer].v[0, h, pre : pre + n] for layer, h in heads])
    qv = jnp.broadcast_to(refs.valid[0], q.shape[:2])
    qhv = jnp.broadcast_to(held.valid[0], qh.shape[:2])

    fit_all = jax.jit(lambda *a: jax.lax.map(lambda x: per_head(*x), a))
    refine_all = jax.jit(lambda *a: jax.lax.map(lambda x: refine(*x), a))
    timings = {}
    compiled = fit_all.lower(q, qv, k, v).compile()
    start = time.perf_counter()
    selected, ck, beta, cv = jax.block_until_ready(compiled(q, qv, k, v))
    timings["closed form"] = time.perf_counter() - start
    compiled = refine_all.lower(q, qv, k, v, ck, beta, cv).compile()
    start = time.perf_counter()
    beta_r, cv_r = jax.block_until_ready(compiled(q, qv, k, v, ck, beta, cv))
    timings[f"refine ({args.steps} Adam steps)"] = time.perf_counter() - start

    loss = jax.jit(
        jax.vmap(
            lambda qq, vv, kk, va, c_k, b, c_v: matching.matching_loss(qq, kk, va, c_k, b, c_v, scale, query_valid=vv)
        )
    )
    kept_v = jnp.take_along_axis(v, selected[..., None], axis=1)
    zero = jnp.zeros_like(beta)
    rows = {
        "eviction (kept pairs as they are)": (zero, kept_v),
        "closed form": (beta, cv),
        f"refined ({args.steps} steps)": (beta_r, cv_r),
    }
    print(
        f"{args.model}, passkey context of {n} tokens, ratio {args.ratio} ({t} keys per head, HAK), "
        f"{len(heads)} heads; objective = relative output error + squared lse error, mean over heads"
    )
    print(f"{'fit':38s} {'reference queries':>18s} {'held-out queries':>17s}")
    for name, (b, c_v) in rows.items():
        ref_loss = float(loss(q, qv, k, v, ck, b, c_v).mean())
        held_loss = float(loss(qh, qhv, k, v, ck, b, c_v).mean())
        print(f"{name:38s} {ref_loss:18.4f} {held_loss:17.4f}")
    for name, seconds in timings.items():
        print(f"time, {name}: {seconds:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
