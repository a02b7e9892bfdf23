#!/usr/bin/env bash
# Runs every test of lily on a fresh machine (no GPU needed): formatting and lints, the Rust unit
# and integration tests, and the Python checks against the reference packages (the real Qwen
# tokenizer, jinja2/transformers chat-template rendering), installed into .venv from pinned
# requirements.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r tests/python/requirements.txt

cargo fmt --check
cargo clippy --release --all-targets -- -D warnings
cargo build --release
cargo test --release
LILY_BIN="$PWD/target/release/lily" .venv/bin/python -m pytest -q tests/python
