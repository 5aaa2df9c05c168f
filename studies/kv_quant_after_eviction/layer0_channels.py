"""The key channels that set a per-token int4 scale on Qwen2.5-Coder-0.5B: per layer and KV head, over one kv_retrieval
context (2,168 tokens), the channels with the largest centred |key| (their standard deviation over tokens, and the
centre the library subtracts), beside the median channel and each token's range across its 64 channels.

    python studies/kv_quant_after_eviction/layer0_channels.py > studies/kv_quant_after_eviction/layer0_channels.txt
"""

import numpy as np

from kvzip_jax import generate as gen
from kvzip_jax import prompts
from kvzip_jax.eval import tasks
from kvzip_jax.weights import registry


def main(name: str = "qwen2.5-coder-0.5b-instruct", layers=(0, 1, 3, 23)) -> None:
    model = registry.load(name)
    example = tasks.generate("kv_retrieval", 1, 0, 640)[0]
    context, _ = prompts.split_for_reuse(
        model.tokenizer, example.context, list(example.questions), instruction=prompts.KVZIP_INSTRUCTION
    )
    _, full = gen.prefill(model.params, model.cfg, [context.ids()])
    n = len(context.ids())
    for i in layers:
        k = np.asarray(full.layers[i].k[0, :, :n], np.float32)  # [K, n, H]
        mid = (k.max(1, keepdims=True) + k.min(1, keepdims=True)) / 2
        centred = k - mid
        for h in range(k.shape[0]):
            largest, sd = np.abs(centred[h]).max(0), centred[h].std(0)  # [H] per channel over tokens
            token_range = centred[h].max(1) - centred[h].min(1)  # [n] per token over channels
            top = np.argsort(-largest)[:6]
            print(
                f"layer {i} head {h}: per-token range median {np.median(token_range):.2f}; channels by largest "
                "|centred k|: "
                + ", ".join(f"{j}:{largest[j]:.1f}(sd {sd[j]:.1f}, centre {mid[h, 0, j]:.1f})" for j in top)
                + f"; median channel: largest {np.median(largest):.2f}, sd {np.median(sd):.2f}"
            )


if __name__ == "__main__":
    main()
