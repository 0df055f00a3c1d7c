#!/usr/bin/env bash
# The GPU measurement of issue 6: pi0.5 (random weights, pi05 preset) with the OxyGen engine on the
# static-shape + CUDA-graph fast path. Run from anywhere on a machine with an NVIDIA GPU:
#
#     bash scripts/gpu_bench.sh                       # ~2-3 min on one H200, prints everything
#
# It installs NOTHING: it needs a Python whose torch has CUDA, plus this repo's Python dependencies
# (numpy, sentencepiece, pillow, safetensors). The interpreter is $PYTHON if set, else the repo's
# .venv/bin/python if present, else python3. Do not use scripts/setup_env.sh to make that
# environment on the GPU machine: it installs a CPU-only torch.
#
# Steps (each a `python -m oxygen_ros.tools.bench` subcommand, JSON + log under $OUT):
#   0. selfcheck (CUDA only, if pytest is installed) tiny model: graph replay == eager static path
#   1. action    action path alone (observation -> prefill -> 10-step chunk -> robot actions on the
#                host), p50/p99 ms for 1, 2, 3 cameras; eager dynamic path vs. fast path
#   2. engines   the paper's workload (1 request/frame, 30 tokens, k=5, 10 steps, 2 cameras) for every
#                engine: frames/s, tokens/s, ratio to isolated-sequential
#   3. realtime  OxyGen under a 60 Hz timer, 2 cameras, a new narration every frame: achieved rate, p99
#                frame latency, deadline misses, tokens/s, concurrent requests, peak GPU memory
#   4. hierarchy subtasks: none vs decoded per call (PR #942) vs in the slack (same_frame)
#   5. serve     oxygen-serve: 1/2/4/8 robots on one server vs as many single-robot servers
#                (separate processes, each its own copy of the weights on the GPU): aggregate
#                frames/s, per-robot p50/p99 and deadline misses, resident memory
#   6. summary   all figures side by side with the issue's targets -> $OUT/summary.json, and what
#                is missing: a step that failed or ran past its limit loses only its own figures,
#                the summary still runs and names them (each step's end is in $OUT/steps.tsv)
# A failing step is reported and the others still run; the exit status is non-zero if any failed.
#
# Environment overrides (defaults in brackets):
#   PYTHON  interpreter [.venv/bin/python or python3]     OUT       output folder [/tmp/oxygen_gpu_bench]
#   PRESET  model preset [pi05]     DEVICE [cuda]     DTYPE [bfloat16]     INIT  weight init [device]
#   FRAMES  engines: measured frames per engine [50]  WARMUP    engines: warm-up frames [10]
#   TOKENS  max tokens per language request [30]
#   SERVE_CLIENTS serve: robot counts [1,2,4,8]   SERVE_PRESET serve: model preset [$PRESET; its
#           random checkpoint is written to disk first: ~13 GB for pi05]
#   REPEATS action: timed runs per camera count [FRAMES]
#   RT_FRAMES realtime: measured ticks [12*FRAMES]    RT_WARMUP realtime: warm-up ticks [6*WARMUP]
#   FAST_FLAGS fast-path flags [--static-shapes --cuda-graphs --gpu-preprocess; no graphs off CUDA]
#   STEP_TIMEOUT seconds per measuring step, 0 for no limit [selfcheck 120, action 120,
#           engines 180, realtime 120, hierarchy 180, serve 900]; the summary always gets 300 s
# CPU dry run (what test/test_gpu_bench_script.py runs):
#   PRESET=tiny DEVICE=cpu DTYPE=float32 FRAMES=5 bash scripts/gpu_bench.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
else
    PY=python3
fi
PRESET=${PRESET:-pi05}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
INIT=${INIT:-device}
FRAMES=${FRAMES:-50}
WARMUP=${WARMUP:-10}
TOKENS=${TOKENS:-30}
REPEATS=${REPEATS:-$FRAMES}
RT_FRAMES=${RT_FRAMES:-$((12 * FRAMES))}
RT_WARMUP=${RT_WARMUP:-$((6 * WARMUP))}
SERVE_CLIENTS=${SERVE_CLIENTS:-1,2,4,8}
SERVE_PRESET=${SERVE_PRESET:-$PRESET}
OUT=${OUT:-/tmp/oxygen_gpu_bench}
if [[ "$DEVICE" == cuda* ]]; then
    FAST_FLAGS=${FAST_FLAGS:---static-shapes --cuda-graphs --gpu-preprocess}
else
    FAST_FLAGS=${FAST_FLAGS:---static-shapes --gpu-preprocess}  # CUDA graphs need CUDA
fi

mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_bench.log") 2>&1

echo "oxygen_ros GPU benchmark: $(date -u +%Y-%m-%dT%H:%M:%SZ), python $PY, out $OUT"
echo "preset=$PRESET device=$DEVICE dtype=$DTYPE init=$INIT frames=$FRAMES warmup=$WARMUP tokens=$TOKENS repeats=$REPEATS" \
    "rt_frames=$RT_FRAMES rt_warmup=$RT_WARMUP fast='$FAST_FLAGS' serve_clients=$SERVE_CLIENTS" \
    "serve_preset=$SERVE_PRESET"

# Fail early and clearly when the interpreter cannot run the benchmark on $DEVICE.
if ! "$PY" - "$DEVICE" >"$OUT/env.txt" 2>&1 <<'EOF'
import sys
device = sys.argv[1]
try:
    import torch
except ImportError:
    sys.exit("torch is not installed in this Python; point PYTHON at an environment with CUDA torch")
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA runtime {torch.version.cuda}")
if device.startswith("cuda"):
    if not torch.cuda.is_available():
        sys.exit(
            "torch.cuda.is_available() is False: this torch has no CUDA support or sees no GPU. "
            "Use a Python with a CUDA build of torch (PYTHON=...), not scripts/setup_env.sh (CPU torch)."
        )
    index = torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    print(f"GPU {index}: {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor}")
import oxygen_ros.engine.static_paths  # noqa: F401  (the repo and its dependencies import)
EOF
then
    cat "$OUT/env.txt"
    echo "gpu_bench.sh: cannot run on $DEVICE with $PY (see above)" >&2
    exit 2
fi
cat "$OUT/env.txt"
if command -v nvidia-smi >/dev/null 2>&1 && [[ "$DEVICE" == cuda* ]]; then
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,power.limit --format=csv | tee -a "$OUT/env.txt"
fi

COMMON=(--preset "$PRESET" --device "$DEVICE" --dtype "$DTYPE" --init "$INIT")
read -r -a FAST <<<"$FAST_FLAGS"
FAILED=()
: >"$OUT/steps.tsv"

# run_step NAME SECONDS CMD...: run under a limit of SECONDS (0: none), log to $OUT/NAME.log, record
# how it ended in $OUT/steps.tsv (name, exit status, seconds) and a failure; never abort the script.
run_step() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS rc
    local timeout=()
    if [[ $limit != 0 ]] && command -v timeout >/dev/null 2>&1; then
        timeout=(timeout --kill-after=30 "$limit")
    fi
    local label="$limit s"
    [[ $limit == 0 ]] && label=none
    echo
    echo "=== $name (limit $label): $*"
    rm -f "$OUT/$name.json"  # a figure left by an earlier run must not pass for this one's
    set +e
    ${timeout[@]+"${timeout[@]}"} "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    set -e
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >>"$OUT/steps.tsv"
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        echo "=== $name: ran past its limit of $limit s (exit $rc); its figures will be missing"
    else
        echo "=== $name: exit $rc after $((SECONDS - start)) s"
    fi
    if [[ $rc -ne 0 ]]; then
        FAILED+=("$name (exit $rc)")
    fi
}
# measure NAME SECONDS CMD...: a measuring step, whose limit STEP_TIMEOUT overrides
measure() {
    local name=$1 limit=${STEP_TIMEOUT:-$2}
    shift 2
    run_step "$name" "$limit" "$@"
}

# 0. On a GPU, first prove on the tiny model that CUDA-graph replay equals eager (seconds).
if [[ "$DEVICE" == cuda* ]] && "$PY" -c "import pytest" >/dev/null 2>&1; then
    measure selfcheck 120 "$PY" -m pytest -q -p no:cacheprovider test/test_static_paths.py -k cuda_graph_replay -rs
fi
BENCH=("$PY" -m oxygen_ros.tools.bench)
measure action 120 "${BENCH[@]}" action "${COMMON[@]}" "${FAST[@]}" --repeats "$REPEATS" --json "$OUT/action.json"
# --rounds 1: every round builds (and captures) each engine afresh; a dedicated GPU does not drift
# the way the shared CPUs do that the default of 3 interleaved rounds is for
measure engines 180 "${BENCH[@]}" engines "${COMMON[@]}" "${FAST[@]}" --cameras 2 --steps 10 --requests-per-frame 1 \
    --tokens "$TOKENS" -k 5 --frames "$FRAMES" --warmup "$WARMUP" --rounds 1 --json "$OUT/engines.json"
measure realtime 120 "${BENCH[@]}" realtime "${COMMON[@]}" "${FAST[@]}" --cameras 2 --steps 10 --rate-hz 60 \
    --requests-per-frame 1 --tokens "$TOKENS" --frames "$RT_FRAMES" --warmup "$RT_WARMUP" --json "$OUT/realtime.json"
# pi0.5's hierarchy: no subtask vs PR #942's decode + re-prefill per call vs subtasks in the slack
measure hierarchy 180 "${BENCH[@]}" hierarchy "${COMMON[@]}" "${FAST[@]}" --threads 0 --frames "$FRAMES" \
    --warmup "$WARMUP" --json "$OUT/hierarchy.json"
# robots on one oxygen-serve vs one server each (every server a process loading the checkpoint)
measure serve 900 "${BENCH[@]}" serve --preset "$SERVE_PRESET" --device "$DEVICE" --dtype "$DTYPE" \
    --clients "$SERVE_CLIENTS" --views equal-cpu --frames "$FRAMES" --warmup "$WARMUP" \
    --json "$OUT/serve.json"
# the summary is cheap and says what the others left missing: it never takes STEP_TIMEOUT
run_step summary 300 "${BENCH[@]}" summary --dir "$OUT"

echo
echo "total $SECONDS s; results in $OUT (action.json engines.json realtime.json hierarchy.json serve.json" \
    "summary.json, *.log)"
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "FAILED steps: ${FAILED[*]}" >&2
    exit 1
fi
