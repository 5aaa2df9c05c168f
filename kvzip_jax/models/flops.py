"""Matmul FLOP counts of the decoder, to turn measured times into achieved GFLOP/s. MLA layers count the absorbed
form (models/mla.py): per head, q.k over [latent | RoPE key] and p.v over the latent, W_UK and W_UV per token."""

from kvzip_jax.config import ModelConfig


def linear_flops_per_token(cfg: ModelConfig) -> int:
    """2 x multiply-adds of the q/k/v/o projections and the MLP, per token per model (no LM head)."""
    D, F, H, N, K = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    per_layer = D * (N + 2 * K) * H + N * H * D + 3 * D * F
    if cfg.mla is not None:
        m = cfg.mla
        q = D * N * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        if m.q_lora_rank is not None:
            q = D * m.q_lora_rank + m.q_lora_rank * N * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        per_layer = (
            q
            + D * (m.kv_lora_rank + m.qk_rope_head_dim)
            + N * m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim)  # W_UK into q, W_UV after
            + N * m.v_head_dim * D
            + 3 * D * F
        )
    return 2 * per_layer * cfg.num_layers


def attention_widths(cfg: ModelConfig) -> tuple[int, int]:
    """Per head and key: the widths of q.k and of p.v ((H, H); MLA absorbed: (R + dr, R))."""
    if cfg.mla is not None:
        return cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim, cfg.mla.kv_lora_rank
    return cfg.head_dim, cfg.head_dim


def attention_flops(cfg: ModelConfig, num_queries: int, keys_before: int = 0) -> int:
    """q.k and p.v FLOPs of num_queries causal queries on top of keys_before cached keys, all layers.

    Sliding-window layers count only the keys inside their window.
    """
    total = 0
    for layer in range(cfg.num_layers):
        window = cfg.window_for(layer)
        pairs = 0
        for t in range(num_queries):
            visible = keys_before + t + 1
            pairs += min(visible, window) if window else visible
        total += 2 * pairs * sum(attention_widths(cfg)) * cfg.num_heads
    return total


def prefill_flops(cfg: ModelConfig, num_tokens: int) -> int:
    """FLOPs a causal prefill of num_tokens must do, with LM-head logits for the last token only."""
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size
    return linear_flops_per_token(cfg) * num_tokens + attention_flops(cfg, num_tokens) + lm_head


def kvzip_scoring_flops(
    cfg: ModelConfig, cached: int, reread_lengths: list[int], chunk_lengths: list[int], scored_layers: int
) -> int:
    """FLOPs KVzip's reconstruction scoring must do over a cache of `cached` tokens ([prefix | context]).

    Per chunk t, the reread of reread_lengths[t] tokens runs on top of the whole cache, without the LM head and
    without what the last layer computes after its attention weights (p.v, output projection, MLP). In every scored
    layer the chunk's scores then need q.k over its chunk_lengths[t] keys once more (no [reread x keys] array is
    kept); their softmax normaliser comes from the forward's attention.
    """
    D, F, N = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads
    qk, pv = attention_widths(cfg)
    out_width = cfg.mla.v_head_dim if cfg.mla is not None else cfg.head_dim
    last_layer_tail = 2 * (N * out_width * D + 3 * D * F)
    total = 0
    for w, chunk in zip(reread_lengths, chunk_lengths):
        total += (linear_flops_per_token(cfg) - last_layer_tail) * w
        total += attention_flops(cfg, w, cached)
        total -= 2 * (cached * w + w * (w + 1) // 2) * pv * N  # the last layer's p.v
        total += scored_layers * 2 * chunk * w * qk * N
    return total
