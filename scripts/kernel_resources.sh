#!/usr/bin/env bash
# Registers, spills, stack frame, static shared memory and machine-code size of every CUDA kernel, without a
# GPU: compiles the kernels with NVRTC (`lily kernels --check`, into a fresh cache directory) and
# runs ptxas -v on each module's PTX for sm_90a. Whether a kernel's blocks fit on an SM beside the
# previous kernel's (and so request their data before it ends) follows from these numbers; the
# code size (the cubin's `.text.KERNEL` section, 16 bytes an instruction; read with readelf)
# bounds what a block fetches cold, since a decode kernel runs most of its code once. A stack
# frame larger than the spills is local memory the code addresses (an array indexed at run time,
# a struct picked by reference), which every thread then writes and reads through L1.
# LILY_DEFINES (see README) applies, so a define's effect on code size shows here too.
#   scripts/kernel_resources.sh [PATTERN]   (PATTERN: a grep -E filter on the lines, so on kernel
#   and module names, e.g. 'moe_down .*bits_8')
# Needs the CUDA build (cargo build --release --features cuda --target-dir target/cuda) and
# installs NVRTC and ptxas from PyPI into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check nvidia-cuda-nvrtc==13.0.88 \
    "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-nvcc==13.0.*"
cuda_root="$(.venv/bin/python -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')"
cache="$(mktemp -d)"
ptx_dir="$(mktemp -d)"
trap 'rm -rf "$cache" "$ptx_dir"' EXIT
LILY_CACHE_DIR="$cache" LD_LIBRARY_PATH="$cuda_root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    CUDA_INCLUDE_DIR="$cuda_root/include" target/cuda/release/lily kernels --check \
    --ptx-dir "$ptx_dir" >/dev/null
# One line per kernel and module variant (the PTX file's name: module, then the shape and the
# experts' format it was compiled for, or `fp16_scales` / `traced`).
for ptx in "$ptx_dir"/*.ptx; do
    cubin="${ptx%.ptx}.cubin"
    log="$("$cuda_root/bin/ptxas" -arch=sm_90a -v "$ptx" -o "$cubin" 2>&1)"
    # Each kernel's code bytes, "NAME BYTES" (readelf prints the sizes in hex).
    readelf -SW "$cubin" 2>/dev/null | sed -n 's/^ *\[ *[0-9]*\] *//p' | while read -r section _ _ _ size _; do
        case "$section" in .text.*) echo "${section#.text.} $((16#$size))" ;; esac
    done >"$ptx_dir/code"
    echo "$log" | awk -v module="$(basename "$ptx" .ptx)" '
             NR == FNR { code[$1] = $2; next }
             /Compiling entry function/ { name = $7; gsub(/\047/, "", name) }
             /spill stores/ { stack = $1; spills = $5 }
             /Used [0-9]+ registers/ {
                 smem = match($0, /[0-9]+ bytes smem/) ? substr($0, RSTART, RLENGTH - 11) : 0
                 printf "%-28s %4s registers %5s B spilled %5s B stack %7s B static shared %7s B code  %s\n",
                     name, $5, spills, stack, smem, code[name], module }' "$ptx_dir/code" -
done | grep -E "${1:-.}" | sort
