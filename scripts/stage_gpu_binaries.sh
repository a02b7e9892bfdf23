#!/usr/bin/env bash
# Builds lily and the CUDA test binary with the `cuda` feature and copies them, stripped, into
# target/gpu/ (what gpu_check.sh runs and what a device call carries: `carry: ["target/gpu"]`).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --features cuda --target-dir target/cuda
tests="$(cargo test --release --features cuda --target-dir target/cuda --test cuda --no-run \
    --message-format=json 2>/dev/null | grep '"kind":\["test"\]' | grep -o '"executable":"[^"]*"' |
    tail -1 | cut -d'"' -f4)"
mkdir -p target/gpu
cp target/cuda/release/lily target/gpu/lily
cp "$tests" target/gpu/cuda-tests
strip target/gpu/lily target/gpu/cuda-tests
ls -la target/gpu
