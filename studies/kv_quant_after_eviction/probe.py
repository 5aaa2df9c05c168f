"""Why does KVzip 0.3 + int4 lose exact short numbers on Qwen2.5-Coder-0.5B when each part alone keeps them?

For each task (key_numbers: eight "jpiexg: 564" lines in prose; kv_retrieval: a JSON object of UUIDs), 6 contexts of
about 640 tokens and 4 questions each are prefilled in one batch in float32 and scored by KVzip; the cache is masked at
ratio 0.3 (or kept whole). Then parts of it are fake-quantized (quantize, dequantize: what the library's quantized
cache computes, checked against it on the first variant) and every question is answered greedily from it. Printed
per variant: questions right per task, and the mean log-probability of the reference answer's tokens (teacher
forced), a finer signal than right or wrong.

    python studies/kv_quant_after_eviction/probe.py [SECTION ...] > studies/kv_quant_after_eviction/results.txt
    python studies/kv_quant_after_eviction/probe.py k8v4 --tasks kv_retrieval --first 6 > .../results-k8v4.txt

--first N takes the contexts N..N+5 of each task (a generated example is the same whatever the count drawn).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import kvzip, prompts
from kvzip_jax.eval import answering, metrics, tasks
from kvzip_jax.quant import groups as quant
from kvzip_jax.weights import registry

TASKS = ("key_numbers", "kv_retrieval")
CONTEXTS, TOKENS, RATIO = 6, 640, 0.3
INT4 = quant.QuantFormat(bits=4, group=64)


@dataclasses.dataclass(frozen=True)
class Quant:
    """One fake-quantization recipe for a masked dense cache.

    keys / values: a QuantFormat or None (left at full precision); layers: the layers quantized (None: all);
    center: "kept" (midpoint over the visible pairs: the library's), "context" (over every filled pair of the full
    cache), "mean" (the visible pairs' mean), or None; spare: pairs left at full precision ("prefix", or a float f:
    each head's top f of its kept context pairs by KVzip score); spare_bits: those pairs at 8 bits instead;
    scale: the scale and zero point dtype ("float32" rounds nothing); kivi: keys per channel in groups of 32 kept
    pairs (KIVI) instead of per token; channel_scale: centred keys divided per channel by their visible pairs'
    largest magnitude before quantizing (and multiplied back); int8_key_layers: layers whose keys take int8."""

    keys: quant.QuantFormat | None = INT4
    values: quant.QuantFormat | None = INT4
    layers: tuple[int, ...] | None = None
    center: str | None = "kept"
    spare: str | float | None = None
    spare_bits: int | None = None
    scale: str = "bfloat16"
    kivi: bool = False
    channel_scale: bool = False
    int8_key_layers: tuple[int, ...] = ()


def fake(x: jax.Array, fmt: quant.QuantFormat, scale: str) -> jax.Array:
    """x [..., H] quantized and dequantized per token in fmt, scales in `scale` (float32: unrounded)."""
    if scale != "float32":
        return quant.dequantize(quant.quantize(x, dataclasses.replace(fmt, scale_dtype=scale)))
    g = fmt.group
    groups = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // g, g))
    low, high = groups.min(-1, keepdims=True), groups.max(-1, keepdims=True)
    s = (high - low) / fmt.levels
    codes = jnp.round((groups - low) / jnp.where(s > 0, s, 1.0))
    return (low + codes * s).reshape(x.shape)


def fake_kivi(k: jax.Array, visible: jax.Array, bits: int = 4, group: int = 32) -> jax.Array:
    """k [B, K, C, H]: each head's visible slots, in order, quantized per channel in groups of `group` of them
    (the last group padded with its own last row), the other slots as given."""
    fmt = quant.QuantFormat(bits=bits, group=group, along="tokens")
    C = k.shape[2]
    order = jnp.argsort(~visible, axis=-1, stable=True)  # [B, K, C] visible slots first, in slot order
    count = visible.sum(-1)  # [B, K]
    rows = jnp.take_along_axis(k, order[..., None], axis=2)  # [B, K, C, H]
    last = jnp.take_along_axis(rows, jnp.maximum(count - 1, 0)[..., None, None], axis=2)  # [B, K, 1, H]
    rows = jnp.where((jnp.arange(C) < count[..., None])[..., None], rows, last)
    rows = quant.dequantize(quant.quantize(rows, fmt))
    back = jnp.argsort(order, axis=-1)
    return jnp.where(visible[..., None], jnp.take_along_axis(rows, back[..., None], axis=2), k)


def quantize_cache(
    cache: kv.KVCache, recipe: Quant, spared: list[jax.Array] | None, context_centres: list[jax.Array]
) -> kv.KVCache:
    """The masked cache with its visible pairs fake-quantized by recipe; spared[l] [B, K, C] marks pairs kept at
    full precision (or spare_bits)."""
    layers = []
    for i, layer in enumerate(cache.layers):
        if recipe.layers is not None and i not in recipe.layers:
            layers.append(layer)
            continue
        visible = kv.visible_slots(layer)  # [B, K, C]
        k, v = layer.k.astype(jnp.float32), layer.v.astype(jnp.float32)
        if recipe.center == "kept":
            centre = kv._key_center(layer)
        elif recipe.center == "context":
            centre = context_centres[i]
        elif recipe.center == "mean":
            centre = jnp.where(visible[..., None], k, 0).sum(2) / jnp.maximum(visible.sum(-1), 1)[..., None]
        else:
            centre = jnp.zeros(k.shape[:2] + k.shape[-1:])
        if recipe.center is not None and recipe.scale != "float32":
            centre = centre.astype(recipe.scale).astype(jnp.float32)
        centre = centre[:, :, None, :]  # [B, K, 1, H]
        new_k, new_v = k, v
        if recipe.keys is not None:
            key_fmt = quant.QuantFormat(bits=8, group=64) if i in recipe.int8_key_layers else recipe.keys
            div = 1.0
            if recipe.channel_scale:
                div = jnp.where(visible[..., None], jnp.abs(k - centre), 0).max(axis=2, keepdims=True)
                div = jnp.maximum(div, 1e-6).astype(recipe.scale).astype(jnp.float32)
            new_k = (
                fake_kivi(k - centre, visible) if recipe.kivi else fake((k - centre) / div, key_fmt, recipe.scale) * div
            ) + centre
        if recipe.values is not None:
            new_v = fake(v, recipe.values, recipe.scale)
        if spared is not None:
            keep = spared[i][..., None]
            if recipe.spare_bits:
                eight = quant.QuantFormat(bits=recipe.spare_bits, group=64)
                hi_k, hi_v = fake(k - centre, eight, recipe.scale) + centre, fake(v, eight, recipe.scale)
            else:
                hi_k, hi_v = k, v
            new_k, new_v = jnp.where(keep, hi_k, new_k), jnp.where(keep, hi_v, new_v)
        layers.append(dataclasses.replace(layer, k=new_k.astype(layer.k.dtype), v=new_v.astype(layer.v.dtype)))
    return dataclasses.replace(cache, layers=tuple(layers))


def spared_pairs(cache: kv.KVCache, scores: jax.Array, prefix_len, context_len, spare) -> list[jax.Array]:
    """Per layer [B, K, C]: the pairs a recipe's `spare` keeps at full precision."""
    out = []
    for layer, layer_scores in zip(cache.layers, scores):  # [B, K, n]
        C = layer.capacity
        slots = jnp.arange(C)
        offset = slots[None, :] - prefix_len[:, None]  # [B, C]
        in_context = (offset >= 0) & (offset < context_len[:, None])
        if spare == "prefix":
            out.append(jnp.broadcast_to((offset < 0)[:, None, :], layer.keep.shape))
            continue
        s = jnp.take_along_axis(layer_scores, jnp.clip(offset, 0, layer_scores.shape[-1] - 1)[:, None, :], axis=-1)
        kept = layer.keep & in_context[:, None, :]  # [B, K, C] kept context pairs
        s = jnp.where(kept, s, -jnp.inf)
        count = jnp.ceil(spare * kept.sum(-1)).astype(jnp.int32)  # [B, K]
        rank = jnp.argsort(jnp.argsort(-s, axis=-1), axis=-1)  # [B, K, C] 0 = highest
        out.append(kept & (rank < count[..., None]))
    return out


SECTIONS = ("parts", "pairs", "groups", "centre", "scale", "fixes", "layers", "k8v4")


def main(*argv: str, name: str = "qwen2.5-coder-0.5b-instruct") -> None:
    sections, first, tasks_run = [], 0, TASKS
    args = iter(argv)
    for a in args:
        if a == "--first":
            first = int(next(args))
        elif a == "--tasks":
            tasks_run = tuple(next(args).split(","))
        else:
            sections.append(a)
    sections = tuple(sections) or SECTIONS[:-1]
    if set(sections) - set(SECTIONS):
        raise SystemExit(f"sections: {', '.join(SECTIONS)}")
    model = registry.load(name)
    tok, params, cfg = model.tokenizer, model.params, model.cfg
    stops = prompts.stop_token_ids(tok)
    print(
        f"{name}, float32; int4 = per token and KV head, groups of 64 (the head dim), bf16 scale and zero, keys "
        f"centred per channel on their kept pairs' midpoint (the library's int4 before this study); KVzip ratio "
        f"{RATIO}"
    )
    data = {}
    for task in tasks_run:
        examples = tasks.generate(task, first + CONTEXTS, 0, TOKENS)[first:]
        split = [
            prompts.split_for_reuse(tok, ex.context, list(ex.questions), instruction=prompts.KVZIP_INSTRUCTION)
            for ex in examples
        ]
        contexts = [c for c, _ in split]
        _, full = gen.prefill(params, cfg, [c.ids() for c in contexts])
        prefix_len = jnp.array([c.context_start for c in contexts], jnp.int32)
        context_len = jnp.array([c.context_end - c.context_start for c in contexts], jnp.int32)
        reread = kvzip.reread_inputs(tok, prefix_len, [c.ids()[c.context_slice] for c in contexts])
        masked, scores = kvzip.score_and_evict(params, cfg, full, reread, RATIO)
        centres = [kv._key_center(layer) for layer in full.layers]
        refs = [[np.asarray(prompts.encode_text(tok, a[0]), np.int32) for a in ex.answers] for ex in examples]
        data[task] = dict(
            examples=examples,
            suffixes=[s for _, s in split],
            full=full,
            masked=masked,
            scores=scores,
            prefix_len=prefix_len,
            context_len=context_len,
            centres=centres,
            refs=refs,
        )
        print(
            f"{task}: contexts {first}-{first + CONTEXTS - 1}, of {int(context_len.min())}-{int(context_len.max())} "
            "context tokens, "
            f"{sum(len(ex.questions) for ex in examples)} questions"
        )

    def answers(task: str, cache: kv.KVCache, greedy: bool = True):
        d = data[task]
        work, right, logp, preds = answering.copy_cache(cache), [], [], []
        for i in range(len(d["examples"][0].questions)):
            forced = [np.append(r[i], stops[0]) for r in d["refs"]]
            got, work = answering.answer_forced(
                params,
                cfg,
                work,
                [s[i] for s in d["suffixes"]],
                forced,
                d["examples"][0].max_new_tokens if greedy else 0,
                stops,
            )
            lp = np.asarray(
                jnp.take_along_axis(metrics.log_probs(got.logits), jnp.asarray(_pad(forced))[..., None], axis=-1)[
                    ..., 0
                ]
            )  # [B, A] log p of each forced token
            for b, ex in enumerate(d["examples"]):
                text = tok.decode([t for t in got.tokens[b] if t not in stops]).strip()
                preds.append(text)
                right.append(metrics.score(ex.metric, text, ex.answers[i]))
                logp.append(lp[b, : len(d["refs"][b][i])].sum())
        return np.array(right), np.array(logp), preds

    def run(label: str, recipe: Quant | None, base: str = "masked", greedy: bool = True) -> dict:
        start, row = time.perf_counter(), {}
        for task in tasks_run:
            d = data[task]
            cache = d[base]
            if recipe is not None:
                spared = (
                    None
                    if recipe.spare is None
                    else spared_pairs(cache, d["scores"], d["prefix_len"], d["context_len"], recipe.spare)
                )
                cache = quantize_cache(cache, recipe, spared, d["centres"])
            row[task] = answers(task, cache, greedy)
        cells = "  ".join(
            f"{t} {f'{int(r.sum()):2d}/{len(r)}' if greedy else '  -  '} (log p {lp.mean():6.2f})"
            for t, (r, lp, _) in row.items()
        )
        print(f"{label:<58s} {cells}   [{time.perf_counter() - start:.0f} s]", flush=True)
        return row

    run("full cache, 16 bits", None, "full")
    run("full cache, int4", Quant(), "full")
    base = run("KVzip 0.3, 16 bits", None)
    worst = run("KVzip 0.3 + int4 (keys and values)", Quant())
    for task in tasks_run:  # the library's own quantized cache gives the same answers as the fake-quantized one
        d = data[task]
        lib = answers(task, kv.quantized(d["masked"], INT4))
        same = sum(a == b for a, b in zip(lib[2], worst[task][2]))
        print(
            f"  check, {task}: the library's kv.quantized answers {int(lib[0].sum())}/{len(lib[0])}, "
            f"{same}/{len(lib[2])} answers the same as the fake-quantized cache's"
        )
    for task in tasks_run:
        for (r0, _, p0), (r1, _, p1) in [(base[task], worst[task])]:
            lost = [f"{p1[j]!r} for {p0[j]!r}" for j in range(len(p0)) if r0[j] and not r1[j]]
            print(f"  {task}, answers int4 loses: {'; '.join(lost[:8])}")

    if "parts" in sections:
        parts(run)
    if "pairs" in sections:
        pairs(run)
    if "groups" in sections:
        groups(run)
    if "centre" in sections:
        centre(run)
    if "scale" in sections:
        scale(run)
    if "fixes" in sections:
        fixes(run)
    if "layers" in sections:
        layers(run, cfg.num_layers)
    if "k8v4" in sections:
        k8v4(run)


def parts(run) -> None:
    print("\n# keys or values")
    run("KVzip 0.3 + int4 keys only", Quant(values=None))
    run("KVzip 0.3 + int4 values only", Quant(keys=None))
    run("KVzip 0.3 + int8 keys, int4 values", Quant(keys=quant.QuantFormat(bits=8, group=64)))
    run("KVzip 0.3 + int4 keys, int8 values", Quant(values=quant.QuantFormat(bits=8, group=64)))


def pairs(run) -> None:
    print("\n# which pairs: spared (kept at 16 bits, or int8) while the rest is int4")
    run("the never-evicted prefix at 16 bits", Quant(spare="prefix"))
    for f in (0.05, 0.1, 0.25, 0.5):
        run(f"each head's top {f:.0%} of kept pairs at 16 bits", Quant(spare=f))
    for f in (0.1, 0.25):
        run(f"each head's top {f:.0%} of kept pairs at int8", Quant(spare=f, spare_bits=8))


def groups(run) -> None:
    print("\n# groups and layouts")
    for g in (32, 16):
        run(
            f"per-token groups of {g}",
            Quant(keys=quant.QuantFormat(bits=4, group=g), values=quant.QuantFormat(bits=4, group=g)),
        )
        run(f"per-token groups of {g}, keys only (values groups of 64)", Quant(keys=quant.QuantFormat(bits=4, group=g)))
        run(
            f"per-token groups of {g}, values only (keys groups of 64)",
            Quant(values=quant.QuantFormat(bits=4, group=g)),
        )
    run("KIVI keys: per channel, groups of 32 kept pairs", Quant(kivi=True))
    run("KIVI keys, not centred", Quant(kivi=True, center=None))


def centre(run) -> None:
    print("\n# the key centre")
    run("no centre", Quant(center=None))
    run("centre over every context pair (the full cache's)", Quant(center="context"))
    run("centre = the kept pairs' mean", Quant(center="mean"))


def scale(run) -> None:
    print("\n# scale and zero point precision")
    run("float16 scale and zero", Quant(scale="float16"))
    run("float32 scale and zero (unrounded)", Quant(scale="float32"))


def fixes(run) -> None:
    print("\n# repairs aimed at layer 0's keys")
    run("layer 0's keys at int8, the rest int4", Quant(int8_key_layers=(0,)))
    run("layer 0's keys at 16 bits, the rest int4", Quant(layers=tuple(range(1, 24))))
    run("keys scaled per channel, groups of 64", Quant(channel_scale=True))
    run("keys scaled per channel, groups of 32", Quant(channel_scale=True, keys=quant.QuantFormat(bits=4, group=32)))
    run(
        "keys in groups of 16 and int8 in layer 0",
        Quant(keys=quant.QuantFormat(bits=4, group=16), int8_key_layers=(0,)),
    )


def k8v4(run) -> None:
    print("\n# int8 keys with int4 values, against int4 in groups of 16 (the library's int4 now)")
    g16 = quant.QuantFormat(bits=4, group=16)
    run("full cache, int4 in groups of 16", Quant(keys=g16, values=g16), "full")
    run("KVzip 0.3 + int4 in groups of 16", Quant(keys=g16, values=g16))
    run(
        "KVzip 0.3 + int8 keys, int4 values in groups of 16",
        Quant(keys=quant.QuantFormat(bits=8, group=64), values=g16),
    )
    run("KVzip 0.3 + int8 keys, int4 values in groups of 64", Quant(keys=quant.QuantFormat(bits=8, group=64)))


def layers(run, num_layers: int) -> None:
    print("\n# one layer at a time in int4, the rest at 16 bits (log p of the reference only)")
    for i in range(num_layers):
        run(f"layer {i:2d} alone, keys", Quant(layers=(i,), values=None), greedy=False)
        run(f"layer {i:2d} alone, values", Quant(layers=(i,), keys=None), greedy=False)


def _pad(rows: list[np.ndarray]) -> np.ndarray:
    out = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out


if __name__ == "__main__":
    main(*sys.argv[1:])
