"""Which part of Qwen2.5-Coder-1.5B's cache does per-token int4 break, and what repairs it?

One context of bench/results/quality.jsonl (its first, 1,481 tokens) is prefilled in float32; its dense cache is
then fake-quantized (quantize, dequantize) in int4, groups of 64, bf16 scales, in a chosen part: all layers, keys
or values only, one layer at a time, and the keys transformed first (centred per channel on the midpoint of their
range; also divided per channel by their largest magnitude ** alpha, QServe's SmoothAttention; or quantized per
channel in groups of 32 tokens, KIVI's keys). The figure is the KL(full || quantized) of the next token after each
of the context's first three questions, averaged.

    python studies/kv_quant_centering/layer_probe.py > studies/kv_quant_centering/results.txt
"""

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import prompts
from kvzip_jax.quant import groups as quant
from kvzip_jax.weights import registry

FORMAT = quant.QuantFormat(bits=4, group=64)
KIVI = quant.QuantFormat(bits=4, group=32, along="tokens")


def fake_keys(x, n: int, center=False, smooth=0.0, along="head_dim"):
    """x [B, K, C, H] dequantized after the transform, with the context's n slots setting centres and divisors."""
    context = x[:, :, :n]
    mid = (context.max(axis=2, keepdims=True) + context.min(axis=2, keepdims=True)) / 2 if center else 0.0
    y = x - mid
    div = jnp.maximum(jnp.abs(y[:, :, :n]).max(axis=2, keepdims=True), 1e-6) ** smooth if smooth else 1.0
    y = y / div
    if along == "tokens":
        T = y.shape[2] // KIVI.group * KIVI.group
        y = jnp.concatenate([quant.dequantize(quant.quantize(y[:, :, :T], KIVI)), y[:, :, T:]], axis=2)
    else:
        y = quant.dequantize(quant.quantize(y, FORMAT))
    return (y * div + mid).astype(x.dtype)


def fake(x):
    return quant.dequantize(quant.quantize(x, FORMAT)).astype(x.dtype)


def main(name: str = "qwen2.5-coder-1.5b-instruct") -> None:
    model = registry.load(name)
    example = json.loads(open("bench/results/quality.jsonl").readline())
    context, suffixes = prompts.split_for_reuse(
        model.tokenizer, example["context"], example["queries"][:3], instruction=prompts.KVZIP_INSTRUCTION
    )
    _, full = gen.prefill(model.params, model.cfg, [context.ids()])
    n = len(context.ids())
    V = model.cfg.vocab_size

    def next_token(cache):
        out = []
        for suffix in suffixes:
            logits, _ = gen.prefill(model.params, model.cfg, [suffix], jax.tree.map(jnp.copy, cache))
            out.append(jax.nn.log_softmax(logits.reshape(-1)[-V:].astype(jnp.float32)))
        return out

    reference = next_token(full)

    def kl(keys=lambda i, k: k, values=lambda i, v: v) -> float:
        layers = tuple(
            dataclasses.replace(layer, k=keys(i, layer.k), v=values(i, layer.v)) for i, layer in enumerate(full.layers)
        )
        got = next_token(kv.KVCache(layers, full.next_position))
        return float(np.mean([jnp.sum(jnp.exp(r) * (r - g)) for r, g in zip(reference, got)]))

    print(f"{name}: context of {n} tokens, float32, int4 in groups of 64 (bf16 scales)")
    for i, layer in enumerate(full.layers):
        k = np.asarray(layer.k[:, :, :n], np.float32)
        print(
            f"layer {i:2d}: largest |k| {np.abs(k).max():6.1f} (median over channels of the largest "
            f"{np.median(np.abs(k).max(axis=2)):.1f}), largest |v| {np.abs(np.asarray(layer.v[:, :, :n])).max():.2f}"
        )
    both = lambda **kw: kl(lambda i, k: fake_keys(k, n, **kw), lambda i, v: fake(v))
    print(f"all layers, keys and values: KL {both():.4f}")
    print(f"keys only: KL {kl(keys=lambda i, k: fake(k)):.4f}; values only: KL {kl(values=lambda i, v: fake(v)):.4f}")
    for i in range(len(full.layers)):
        only_k = kl(keys=lambda j, k: fake(k) if j == i else k)
        only_v = kl(values=lambda j, v: fake(v) if j == i else v)
        print(f"layer {i:2d} alone: keys KL {only_k:.4f}, values KL {only_v:.4f}")
    for label, kw in (
        ("keys centred", dict(center=True)),
        ("keys centred, smoothed alpha 0.5", dict(center=True, smooth=0.5)),
        ("keys centred, smoothed alpha 1", dict(center=True, smooth=1.0)),
        ("keys smoothed alpha 0.5", dict(smooth=0.5)),
        ("keys smoothed alpha 1", dict(smooth=1.0)),
        ("keys per channel, 32-token groups (KIVI)", dict(along="tokens")),
    ):
        print(f"all layers, {label}: KL {both(**kw):.4f}")
    k0 = np.asarray(full.layers[0].k[0, :, :n], np.float32)  # [K, n, H]
    head, channel = np.unravel_index(np.abs(k0).max(axis=1).argmax(), (k0.shape[0], k0.shape[2]))
    col = k0[head, :, channel]
    print(
        f"layer 0's largest channel (head {head}, channel {channel}) over the context: min {col.min():.1f}, "
        f"max {col.max():.1f}, std {col.std():.2f}"
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
