#!/usr/bin/env bash
# Builds the CUDA lily binary of the committed tree and of the tree with each given patch applied
# (one at a time), stripped, into target/variants/NAME/lily: NAME is `base` for the tree itself and
# the patch's file name without `.patch` for the others. Carry `target/variants` to the GPU
# machine and compare them there in one call with scripts/ab_decode.sh, e.g.
#   scripts/build_variants.sh docs/experiments/*.patch
#   scripts/ab_decode.sh -r 3 base=target/variants/base/lily \
#       staged=target/variants/moe-staged-act/lily
# Each patch is reverted after its build, also when the build fails.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! git diff --quiet HEAD; then
    echo "build_variants.sh: the tree has uncommitted changes; commit or stash them first" >&2
    exit 2
fi
for patch in "$@"; do
    if ! git apply --check "$patch"; then
        echo "build_variants.sh: $patch does not apply to this tree" >&2
        exit 2
    fi
done

build() {
    cargo build --release --features cuda --target-dir target/cuda
    mkdir -p "target/variants/$1"
    cp target/cuda/release/lily "target/variants/$1/lily"
    strip "target/variants/$1/lily"
}

build base
for patch in "$@"; do
    git apply "$patch"
    trap 'git apply -R "$patch"' EXIT
    build "$(basename "$patch" .patch)"
    git apply -R "$patch"
    trap - EXIT
done
ls -la target/variants/*/lily
