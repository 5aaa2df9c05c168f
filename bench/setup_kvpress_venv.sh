#!/usr/bin/env bash
# Creates .venv-kvpress (NVIDIA kvpress 0.5.5 + transformers 5.2 + CPU torch 2.13) for bench/kvpress_peer.py.
# Idempotent: reuses the venv when present; pip skips what is already installed.
#   bash bench/setup_kvpress_venv.sh
# torch==2.13.0 resolves to the local CPU wheel (2.13.0+cpu) on the project machines; kvpress needs
# transformers<5.3; gguf + accelerate let transformers load the bundled GGUF models.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-kvpress
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q "kvpress==0.5.5" "transformers==5.2.0" "gguf==0.19.0" "accelerate==1.15.0"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
print(" ".join(f"{p}=={md.version(p)}" for p in ("kvpress", "transformers", "torch", "gguf", "accelerate")))
PY
