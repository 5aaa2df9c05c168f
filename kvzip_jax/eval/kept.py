"""What a compression kept, as pictures: the document with each token shaded by the share of (layer, KV head) pairs
that kept it (HTML), and a figure of the kept share per (layer, KV head) beside the kept share along the context.

    share = kept.fractions(masked, prefix_len, context_len)   # from a masked (or compacted) cache
    Path("kept.html").write_text(kept.html(tokenizer, context_ids, share.per_token))
    kept.plot(share, "kept.png")

Einsum legend: L layers, K KV heads, n context tokens.
"""

from __future__ import annotations

import dataclasses
import html as html_text
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvzip_jax import cache as kv
from kvzip_jax.eval.report import write_atomic

SMOOTHING = 32  # tokens averaged in the smoothed line of the plot


@dataclasses.dataclass(frozen=True)
class KeptShare:
    """per_head [L, K]: the share of the context each (layer, KV head) kept; per_token [n]: the share of (layer, KV
    head) pairs that kept each context token; both in [0, 1]."""

    per_head: np.ndarray
    per_token: np.ndarray


def fractions(masked: kv.KVCache, prefix_len: int, context_len: int, row: int = 0) -> KeptShare:
    """The kept shares of one row's context [prefix_len, prefix_len + context_len) in a masked or compacted cache."""
    if context_len < 1:
        raise ValueError("the context is empty")
    visible = []
    for layer in masked.layers:
        if not isinstance(layer, kv.LayerCache):
            raise TypeError("kept shares read a masked cache (before kv.pack)")
        keep = np.ones(layer.k.shape[1:3], bool) if layer.keep is None else np.asarray(layer.keep[row])  # [K, C]
        visible.append(keep[:, prefix_len : prefix_len + context_len])
    kept = np.stack(visible)  # [L, K, n]
    return KeptShare(per_head=kept.mean(axis=2), per_token=kept.mean(axis=(0, 1)))


def html(tokenizer, context_ids, per_token: np.ndarray, title: str = "kept tokens") -> str:
    """A standalone HTML page of the context, each token's background as dark as the share that kept it."""
    if len(context_ids) != len(per_token):
        raise ValueError(f"{len(context_ids)} tokens but {len(per_token)} shares")
    spans = []
    for token, share in zip(context_ids, per_token):
        text = html_text.escape(tokenizer.decode([int(token)])).replace("\n", "<br>\n")
        spans.append(
            f'<span class="t" style="background: rgba(34, 139, 34, {share:.3f})" '
            f'title="kept by {100 * share:.0f}% of (layer, KV head) pairs">{text}</span>'
        )
    mean = float(np.mean(per_token)) if len(per_token) else 0.0
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>'
        + html_text.escape(title)
        + "</title><style>body{font-family:sans-serif;max-width:60em;line-height:1.6}"
        ".t{white-space:pre-wrap}</style></head><body>\n<h3>"
        + html_text.escape(title)
        + f"</h3>\n<p>green: the share of (layer, KV head) pairs that kept the token; {100 * mean:.1f}% of the "
        "context's pairs kept</p>\n<p>" + "".join(spans) + "</p>\n</body></html>\n"
    )


def plot(share: KeptShare, path: str | Path, title: str = "") -> Path:
    """kept share per (layer, KV head) as a heatmap, and along the context; written as PNG to path (whole or not at
    all)."""
    figure = Figure(figsize=(11, 4), layout="constrained")
    heat, along = figure.subplots(1, 2, width_ratios=(1, 2))
    image = heat.imshow(share.per_head, aspect="auto", cmap="Greens", vmin=0, vmax=1, interpolation="nearest")
    heat.set(
        xlabel="KV head", ylabel="layer", title="kept share per (layer, KV head)", xticks=range(share.per_head.shape[1])
    )
    figure.colorbar(image, ax=heat)
    n = len(share.per_token)
    along.plot(np.arange(n), share.per_token, color="forestgreen", linewidth=0.5, alpha=0.5, label="per token")
    width = max(min(SMOOTHING, n // 4), 1)
    smooth = np.convolve(share.per_token, np.ones(width) / width, mode="valid")
    along.plot(np.arange(len(smooth)) + (width - 1) / 2, smooth, color="darkgreen", label=f"mean of {width}")
    along.legend(loc="upper right")
    along.set(
        xlabel="context token",
        ylabel="share of (layer, KV head) pairs",
        ylim=(0, 1.02),
        title="kept share along the context",
    )
    if title:
        figure.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, lambda tmp: FigureCanvasAgg(figure).print_png(str(tmp)))
