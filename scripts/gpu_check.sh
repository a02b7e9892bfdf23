#!/usr/bin/env bash
# The CUDA backend's correctness checks, run on the GPU machine from the repository root:
#   1. every kernel compiles (NVRTC, sm_90a);
#   2. tests/cuda.rs: CUDA vs CPU backend on the tiny fixtures, logits within 3x the calibrated
#      bf16 spread, device argmax, forks, slots, context limit;
#   3. compute-sanitizer (memcheck) on a short prefill + decode, greedy and sampled (filters
#      within the draw's candidates, and top-k beyond them; penalties over the slot's history,
#      drawn and greedy), on a 700-token prompt of the 4-bit
#      fixture (the tensor-core products, grouped experts, chunkwise DeltaNet and flash attention
#      of batched prefill), and on the batched-decode tests;
#   4. scripts/gpu_side_by_side.py: three lily processes decoding at once on the GPU, each with
#      the token ids of the same run alone (greedy and sampled);
#   5. scripts/gpu_server_check.py: `lily serve --device cuda` on the demo model with and without
#      the prefix cache (a cached turn's logprobs, structured output, forced tool calls, the
#      Responses API, concurrent requests);
#   6. scripts/gpu_transformers_check.py: lily (CPU and CUDA) vs transformers on a full-width
#      Qwen3.6-35B-A3B truncated to 4 layers with random weights, and on a wider model of the
#      same architecture (hidden 4096, top-10 experts of 1024, 64 DeltaNet value heads), whose
#      4-bit conversion is also run on both backends.
# Binaries are built here (no cargo on the GPU machine) and carried:
#   cargo build --release --features cuda --target-dir target/cuda
#   cargo test --release --features cuda --target-dir target/cuda --test cuda --no-run
#   scripts/stage_gpu_binaries.sh        # copies both, stripped, into target/gpu/
# then: scripts/gpu_check.sh [LOG_DIR]   (LILY_STEP_TIMEOUT: seconds per step, 600 by default;
# LILY_GPU_DIR: where the two binaries are, target/gpu by default, e.g. a build_variants.sh
# variant's folder)
set -uo pipefail
cd "$(dirname "$0")/.."
log="${1:-/tmp/lily-gpu-check}"
mkdir -p "$log"
bin="${LILY_GPU_DIR:-target/gpu}"
lily="$bin/lily"
status=0
# Each step under a time limit: a hung kernel fails its step instead of holding the GPU machine.
limit="${LILY_STEP_TIMEOUT:-600}"
step() {
    local name="$1" started=$SECONDS
    shift
    echo "== $name: $*"
    if timeout "$limit" "$@" >"$log/$name.log" 2>&1; then
        # With its seconds, so that a device call's time can be planned around the steps.
        echo "ok     $name ($((SECONDS - started)) s)"
        # Printed as each step ends, so that a run cut short still shows what it measured.
        grep -h "relative error" "$log/$name.log" || true
    else
        echo "FAILED $name after $((SECONDS - started)) s (see $log/$name.log)"
        tail -n 30 "$log/$name.log"
        status=1
    fi
}

step kernels "$lily" kernels --check
step cuda-tests "$bin/cuda-tests" --test-threads=1 --nocapture
fixture=tests/fixtures/tiny-wrapper
step sanitizer-greedy compute-sanitizer --error-exitcode 1 --tool memcheck \
    "$lily" generate --model "$fixture" --prompt-ids 1,2,3,4,5 --max-tokens 8 --json --device cuda
step sanitizer-sampled compute-sanitizer --error-exitcode 1 --tool memcheck \
    "$lily" generate --model "$fixture" --prompt-ids 1,2,3,4,5 --max-tokens 8 --json --device cuda \
    --temperature 0.8 --top-p 0.9 --seed 1
# Top-k beyond the scan blocks' candidates: the draw's whole-row path (sample.cu).
step sanitizer-sampled-whole-row compute-sanitizer --error-exitcode 1 --tool memcheck \
    "$lily" generate --model "$fixture" --prompt-ids 1,2,3,4,5 --max-tokens 8 --json --device cuda \
    --temperature 2 --top-k 300 --seed 1
# Penalties over the history the slot holds, with a draw and greedy.
step sanitizer-penalised compute-sanitizer --error-exitcode 1 --tool memcheck \
    "$lily" generate --model "$fixture" --prompt-ids 1,2,3,4,5 --max-tokens 8 --json --device cuda \
    --temperature 0.8 --top-k 40 --repetition-penalty 1.2 --presence-penalty 1.5 --seed 1
step sanitizer-penalised-greedy compute-sanitizer --error-exitcode 1 --tool memcheck \
    "$lily" generate --model "$fixture" --prompt-ids 1,2,3,4,5 --max-tokens 8 --json --device cuda \
    --frequency-penalty 0.5
q4="$(mktemp -d)/q4"
step convert-q4 "$lily" convert --model "$fixture" --out "$q4" --bits 4 --group-size 64
long_prompt="$(seq -s, 1 700 | awk -F, '{for (i = 1; i <= NF; i++) printf "%s%d", (i > 1 ? "," : ""), ($i * 37) % 200 + 1}')"
step sanitizer-long-prompt compute-sanitizer --error-exitcode 1 --tool memcheck \
    "$lily" generate --model "$q4" --prompt-ids "$long_prompt" --max-tokens 4 --json --device cuda
# Batched decode steps (bf16 batches on the per-sequence kernels, quantised ones through
# matvec_mma) and single-token prefill chunks.
step sanitizer-batched compute-sanitizer --error-exitcode 1 --tool memcheck \
    "$bin/cuda-tests" --test-threads=1 batched_decode quantized_batches small_batches single_token
# Several processes on the GPU at once (greedy and sampled): each must match the run alone.
step side-by-side python3 scripts/gpu_side_by_side.py --lily "$lily" --model "$q4"
step server python3 scripts/gpu_server_check.py --lily "$lily"
step transformers python3 scripts/gpu_transformers_check.py --lily "$lily" --work /tmp/lily-trunc
step transformers-wide python3 scripts/gpu_transformers_check.py --lily "$lily" --work /tmp/lily-wide \
    --shape wide --quantized
grep -h "GPU error" "$log"/*.log
exit $status
