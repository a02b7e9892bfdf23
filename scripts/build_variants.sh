#!/usr/bin/env bash
# Builds the CUDA lily binary and the CUDA test binary of the committed tree and of the tree
# with each given variant applied (one at a time), stripped, into a fresh
# target/variants/NAME/{lily,cuda-tests} (scripts/gpu_check.sh runs a variant's with
# LILY_GPU_DIR=target/variants/NAME). A variant is a
# patch file, or several joined by `+` (applied together, in that order); NAME is `base` for the
# tree itself and the patches' file names without `.patch`, joined by `+`, for the others.
# Carry `target/variants` to the GPU machine and compare them there in one call with
# scripts/ab_decode.sh, e.g.
#   scripts/build_variants.sh docs/experiments/a.patch docs/experiments/a.patch+docs/experiments/b.patch
#   scripts/ab_decode.sh -r 3 base=target/variants/base/lily a=target/variants/a/lily \
#       both=target/variants/a+b/lily
# Each variant's patches are reverted after its build, also when the build fails.
# With --gzip first, the binaries are stored gzipped (lily.gz ~4.4 MB against ~11.5, so a
# call's 64 MiB carry holds about ten variants); unpack them on the GPU machine with
# `gunzip target/variants/*/*.gz` before running.
set -euo pipefail
cd "$(dirname "$0")/.."
gzip_binaries=0
if [ "${1:-}" = --gzip ]; then
    gzip_binaries=1
    shift
fi
if ! git diff --quiet HEAD; then
    echo "build_variants.sh: the tree has uncommitted changes; commit or stash them first" >&2
    exit 2
fi

applied=()
revert() {
    local i
    for ((i = ${#applied[@]} - 1; i >= 0; i--)); do git apply -R "${applied[i]}"; done
    applied=()
}
trap revert EXIT

# Applies the variant's patches (recorded in `applied` as they go in) and prints its name.
apply_variant() {
    local IFS=+ patch names=()
    for patch in $1; do
        if ! git apply "$patch"; then
            echo "build_variants.sh: $patch does not apply (variant $1)" >&2
            return 2
        fi
        applied+=("$patch")
        names+=("$(basename "$patch" .patch)")
    done
    VARIANT_NAME="${names[*]}"
}

for variant in "$@"; do
    apply_variant "$variant"
    revert
done

build() {
    cargo build --release --features cuda --target-dir target/cuda
    local tests
    tests="$(cargo test --release --features cuda --target-dir target/cuda --test cuda --no-run \
        --message-format=json 2>/dev/null | grep '"kind":\["test"\]' |
        grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)"
    local dir="target/variants/$1"
    mkdir -p "$dir"
    cp target/cuda/release/lily "$dir/lily"
    cp "$tests" "$dir/cuda-tests"
    strip "$dir/lily" "$dir/cuda-tests"
    if [ "$gzip_binaries" = 1 ]; then gzip -9 "$dir/lily" "$dir/cuda-tests"; fi
}

# Only this run's variants, so that carrying the folder carries nothing stale.
rm -rf target/variants
build base
for variant in "$@"; do
    apply_variant "$variant"
    build "$VARIANT_NAME"
    revert
done
ls -la target/variants/*/*
