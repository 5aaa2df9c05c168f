"""The bits a cache's kept pairs are stored in, and the names reports and the CLI give them (a leaf module: quant,
the CLI's options and the reports share it).

16 is the model's dtype; 8 and 4 quantize keys and values alike (int8, int4); "8/4" stores int8 keys beside int4
values ("k8v4").
"""

from __future__ import annotations

KV_BITS = (16, 8, 4, "8/4")


def label(bits: int | str) -> str:
    """The name of a KV_BITS entry: "16-bit", "int8", "int4", "k8v4"."""
    if bits not in KV_BITS:
        raise ValueError(f"kv bits must be one of {KV_BITS}, got {bits!r}")
    if bits == 16:
        return "16-bit"
    return "k8v4" if bits == "8/4" else f"int{bits}"
