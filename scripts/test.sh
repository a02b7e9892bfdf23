#!/usr/bin/env bash
# Runs every test of lily on a fresh machine (no GPU needed): formatting and lints (with and
# without the CUDA backend), the Rust unit and integration tests, an NVRTC compile of every CUDA
# kernel for sm_90a, and the Python checks against the reference packages (the real Qwen
# tokenizer, jinja2/transformers chat-template rendering, MLX-LM), installed into .venv from
# pinned requirements.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
pip() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
pip -r tests/python/requirements.txt
# NVRTC and the CUDA headers, enough to compile the kernels without a GPU or a CUDA install.
pip nvidia-cuda-nvrtc==13.0.88 "nvidia-cuda-runtime==13.0.*"
cuda_root="$(.venv/bin/python -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')"

cargo fmt --check
cargo clippy --release --all-targets -- -D warnings
cargo clippy --release --all-targets --features cuda -- -D warnings
cargo build --release
cargo test --release
LILY_BIN="$PWD/target/release/lily" .venv/bin/python -m pytest -q tests/python

cargo build --release --features cuda --target-dir target/cuda
# The CUDA backend's host-side logic (launch shapes, staging sizes, bench arithmetic) needs no GPU.
cargo test --release --features cuda --target-dir target/cuda --lib -- backend::cuda bench
LD_LIBRARY_PATH="$cuda_root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    CUDA_INCLUDE_DIR="$cuda_root/include" target/cuda/release/lily kernels --check \
    $(for config in tests/fixtures/*/config.json tests/data/layouts/*.json; do
        printf -- '--config %s ' "$config"
    done)
