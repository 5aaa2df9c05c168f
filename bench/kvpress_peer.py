"""NVIDIA kvpress KVzipPress timings on CPU, the peer figures for our JAX KVzip (side by side, same model).

Run with the kvpress venv (bash bench/setup_kvpress_venv.sh), never with the project's venv:

    .venv-kvpress/bin/python bench/kvpress_peer.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --context kvzip_jax/data/demo_document.txt --tokens 2048,4096 [--keep 0.3] [--repeats 2]

Model: transformers float32 on CPU (sdpa attention), loaded from a GGUF (--gguf) or an HF folder (--model-path),
torch.set_num_threads(2). For each N in --tokens, the context file is repeated/truncated to exactly N document
tokens and laid out by kvpress's own "kv-press-text-generation" pipeline preprocessing (chat template: its prefix,
e.g. the ChatML system turn and user header, comes first, so the prefilled sequence is prefix + N tokens; the
pipeline's max_context_length truncation cuts it to that). Then it times, best of --repeats (one untimed warm-up
of each path before the first N only: torch eager has no compilation to amortise):
  prefill_s      model.model(context_ids, past_key_values=DynamicCache()) with no press (the pipeline's prefill);
  kvzip_press_s  the same forward inside `with KVzipPress(compression_ratio=1 - keep)(model):`, i.e. prefill plus
                 everything KVzipPress does on exit (tokenizer load, chunked "repeat the context" reread passes that
                 score every KV pair, global top-k) until its compressed cache exists. It includes the prefill.
kept_fraction: KV pairs not masked, over all layers x KV heads x prefilled positions (prefix included).
kvpress "compresses" by masking (module.masked_key_indices), so the cache keeps its full size.
*_cpu_s: process CPU time of the reported call; far below threads x wall means other processes took the cores.
One JSON object per line on stdout; progress on stderr. Must not import kvzip_jax (not installed in that venv).
"""

from __future__ import annotations

import argparse
import atexit
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF dequantization progress bar

# importing kvpress registers its pipeline and patches attention
import torch
import transformers
from kvpress import KVzipPress
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def load(args, tmp: str):
    """Model and tokenizer; the tokenizer is also saved to tmp, the folder KVzipPress re-loads it from."""
    if args.gguf:
        folder, kw = os.path.dirname(os.path.abspath(args.gguf)), {"gguf_file": os.path.basename(args.gguf)}
    else:
        folder, kw = args.model_path, {}
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa", **kw)
    model.eval()
    # KVzipPress re-loads the tokenizer with AutoTokenizer.from_pretrained(model.config.name_or_path). A GGUF
    # tokenizer saved as is reloads as a CodeLlamaTokenizer that splits text differently (a <|endoftext|> before
    # each word); declaring it a plain fast tokenizer keeps its tokenizer.json exactly.
    tok.save_pretrained(tmp)
    config_path = os.path.join(tmp, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(config, f)
    model.config._name_or_path = tmp
    sample = read(args.context)[:2000]
    reloaded = AutoTokenizer.from_pretrained(tmp)
    assert reloaded.encode(sample) == tok.encode(sample), "tokenizer does not survive the save/reload"
    assert reloaded.chat_template == tok.chat_template
    return model, tok


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def best_of(fn, repeats: int, warmup: bool) -> tuple[float, float, object]:
    """Best wall time of repeats calls, the process CPU time of that call (about threads x wall when the machine
    is otherwise idle, less when other processes take the cores), and its output."""
    if warmup:
        fn()
    best, cpu, out = float("inf"), 0.0, None
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        result = fn()
        wall = time.perf_counter() - start
        if wall < best:
            best, cpu, out = wall, time.process_time() - cpu_start, result
    return best, cpu, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="GGUF file (transformers dequantizes it to float32)")
    src.add_argument("--model-path", help="HF model folder (config, weights, tokenizer)")
    p.add_argument("--context", required=True, help="text file, repeated/truncated to each token count")
    p.add_argument("--tokens", default="2048,4096", help="comma-separated document token counts")
    p.add_argument("--keep", type=float, default=0.3, help="fraction of KV pairs kept (compression_ratio = 1-keep)")
    p.add_argument("--repeats", type=int, default=2, help="timed repeats after one warm-up; best is reported")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    versions = {
        "kvpress_version": importlib.metadata.version("kvpress"),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    tmp = tempfile.mkdtemp(prefix="kvpress_peer_tok_")
    atexit.register(shutil.rmtree, tmp, True)
    t0 = time.perf_counter()
    model, tok = load(args, tmp)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok)
    log(f"loaded {type(model).__name__} in {time.perf_counter() - t0:.1f}s; {versions}")

    text = read(args.context).strip()
    doc_tokens = len(tok.encode(text, add_special_tokens=False))
    # The template prefix, tokenized as KVzipPress does (it never sees a question: the pipeline prefills context only).
    prefix_len = len(pipe.preprocess("x", [""], "", 10**9)["context_ids"][0]) - len(
        tok.encode("x", add_special_tokens=False)
    )

    if os.getloadavg()[0] > args.threads:
        log(f"warning: load average {os.getloadavg()[0]:.1f} > {args.threads} threads; timings will be inflated")
    for i, n in enumerate(int(t) for t in args.tokens.split(",")):
        long_text = "\n\n".join([text] * (n // max(doc_tokens, 1) + 2))
        ids = pipe.preprocess(long_text, [""], "", prefix_len + n)["context_ids"]  # the pipeline's own truncation
        assert ids.shape[1] == prefix_len + n, (ids.shape, prefix_len, n)

        def prefill(ids=ids):
            with torch.no_grad():
                cache = DynamicCache()
                model.model(input_ids=ids, past_key_values=cache)
                return cache

        def kvzip(ids=ids):
            press = KVzipPress(compression_ratio=1.0 - args.keep)
            with torch.no_grad(), press(model):
                cache = DynamicCache()
                model.model(input_ids=ids, past_key_values=cache)
            masked = sum(len(layer.self_attn.masked_key_indices[0]) for layer in model.model.layers)
            return cache, masked

        prefill_s, prefill_cpu, cache = best_of(prefill, args.repeats, warmup=i == 0)
        press_s, press_cpu, (zcache, masked) = best_of(kvzip, args.repeats, warmup=i == 0)
        total = sum(layer.keys.shape[1] * layer.keys.shape[2] for layer in zcache.layers)  # KV heads x positions
        assert zcache.get_seq_length() == cache.get_seq_length() == ids.shape[1]
        row = {
            "tokens": n,
            "prefill_tokens": int(ids.shape[1]),
            "prefill_s": round(prefill_s, 3),
            "kvzip_press_s": round(press_s, 3),
            "prefill_cpu_s": round(prefill_cpu, 3),
            "kvzip_press_cpu_s": round(press_cpu, 3),
            "kept_fraction": round(1.0 - masked / total, 4),
            "keep_target": args.keep,
            "repeats": args.repeats,
            **versions,
        }
        log(
            f"N={n} (+{prefix_len} prefix): prefill {prefill_s:.2f}s, KVzipPress {press_s:.2f}s "
            f"({press_s / prefill_s:.1f}x), kept {row['kept_fraction']:.3f}"
        )
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
