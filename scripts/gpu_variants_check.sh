#!/usr/bin/env bash
# Everything a device call should learn about the builds of scripts/build_variants.sh, most
# important first, so that a call cut short (or a session with one call) still brings back the
# most: run on the GPU machine from the repository root with `carry: ["target/variants"]`:
#   scripts/gpu_variants_check.sh [-r ROUNDS] [-c | -C NAME] [-o OUT_DIR] [TEST_NAME...]
#   1. the base build's CUDA tests named (filters of tests/cuda.rs, e.g. tests new since the last
#      GPU run; none named: skipped);
#   2. 4-bit decode of every variant against base (scripts/ab_decode.sh -r ROUNDS, default 1);
#   3. `lily logits --path decode` of every variant on the tiny fixture converted to 4 bits,
#      compared byte for byte with base's (variants that change only scheduling must match),
#      and with -C NAME with NAME's as well;
#   4. with -c, scripts/gpu_check.sh (the full correctness check: ~3 min on a warm machine, over
#      6.5 on a fresh H100 after the steps above) on the variant that
#      decoded fastest in step 2 among those whose logits matched (base if none beat it), so
#      that one machine start both picks a variant and clears it for landing; with -C NAME, on
#      variant NAME instead, whatever its logits (a variant that changes the arithmetic on
#      purpose, whose tolerance tests/cuda.rs and the transformers check then judge);
#   5. scripts/gpu_server_check.py on base (skipped with -c: gpu_check.sh runs it);
#   6. 8-bit decode of every variant (one round);
#   7. every other variant's CUDA tests in full.
# OUT_DIR ($OUT by default) gets summary.txt and logs.tgz (every step's whole log): two files, well
# inside what a device call brings back. Both are written as the steps go, so a call that runs
# past its time limit still brings back the steps that finished. Without -c, run
# scripts/gpu_check.sh on the chosen variant in a call of its own:
# `LILY_GPU_DIR=target/variants/NAME scripts/gpu_check.sh`.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
rounds=1
check_fastest=0
check_named=""
out="${OUT:-/tmp/lily-variants}"
while getopts "r:co:C:" opt; do
    case "$opt" in
        r) rounds="$OPTARG" ;;
        c) check_fastest=1 ;;
        C) check_fastest=1 && check_named="$OPTARG" ;;
        o) out="$OPTARG" ;;
        *) exit 2 ;;
    esac
done
shift $((OPTIND - 1))
V=target/variants
if ! ls $V/*/lily* >/dev/null 2>&1; then
    echo "gpu_variants_check.sh: no builds under $V (scripts/build_variants.sh makes them)" >&2
    exit 2
fi
gunzip -f $V/*/*.gz 2>/dev/null
export LILY_CACHE_DIR="${LILY_CACHE_DIR:-/tmp/lily-kernel-cache}" PYTHONUNBUFFERED=1
logs=$(mktemp -d)/logs
mkdir -p "$logs" "$out"
variants=(base)
for dir in "$V"/*/; do
    name=$(basename "$dir")
    [ "$name" != base ] && variants+=("$name")
done
# Written aside and renamed, so that two saves at once (the half-minute saver below) never
# leave a torn archive.
save_logs() {
    tar czf "$out/.logs.tgz.$BASHPID" -C "$(dirname "$logs")" logs 2>/dev/null
    mv -f "$out/.logs.tgz.$BASHPID" "$out/logs.tgz"
}
labelled=()
for name in "${variants[@]}"; do labelled+=("$name=$V/$name/lily"); done
{
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
    if [ $# -gt 0 ]; then
        echo "== base: CUDA tests $*"
        timeout 300 $V/base/cuda-tests --test-threads=1 "$@" 2>&1 | tee "$logs/base-tests.log" | tail -8
    fi
    echo "== 4-bit decode, $rounds round(s)"
    scripts/ab_decode.sh -r "$rounds" -l "$logs/ab-q4" "${labelled[@]}" 2>&1 | tail -$((4 + 4 * ${#variants[@]}))
    save_logs
    echo "== decode logits on the 4-bit tiny fixture against base"
    scratch="$(dirname "$logs")/scratch"  # beside the logs: the logits are megabytes each
    q4="$scratch/tiny-q4"
    mkdir -p "$scratch"
    $V/base/lily convert --model tests/fixtures/tiny-wrapper --out "$q4" --bits 4 --group-size 64 >/dev/null
    prompt=$(seq 0 299 | awk '{printf "%s%d", (NR > 1 ? "," : ""), ($1 * 7919) % 1000}')
    matching=(base)
    for name in "${variants[@]}"; do
        timeout 120 "$V/$name/lily" logits --model "$q4" --prompt-ids "$prompt" --path decode --device cuda \
            >"$scratch/$name-logits.json" 2>"$logs/$name-logits.err" || echo "$name: logits failed"
    done
    # Against base, and with -C against the named variant too (a refinement of a variant that
    # changes the arithmetic must give its logits bit for bit).
    for reference in base $check_named; do
        for name in "${variants[@]}"; do
            [ "$name" = "$reference" ] && continue
            [ "$reference" != base ] && [ "$name" = base ] && continue
            if cmp -s "$scratch/$reference-logits.json" "$scratch/$name-logits.json"; then
                echo "$name: identical to $reference"
                [ "$reference" = base ] && matching+=("$name")
            else
                python3 -c 'import json, sys
a, b = (json.load(open(f))["logits"] for f in sys.argv[1:3])
print(sys.argv[3] + ": DIFFERENT from " + sys.argv[4] + ", largest difference",
      max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)))' \
                    "$scratch/$reference-logits.json" "$scratch/$name-logits.json" "$name" "$reference"
            fi
        done
    done
    save_logs
    if [ "$check_fastest" = 1 ]; then
        # The variant named by -C, else the highest mean one-sequence rate of ab_decode.sh's
        # results among the matching.
        fastest=$check_named
        [ -n "$fastest" ] || fastest=$(awk -F'\t' -v matching=" ${matching[*]} " '
            $2 == "one sequence" && index(matching, " " $1 " ") { n[$1]++; sum[$1] += $3 }
            END { for (v in n) if (best == "" || sum[v] / n[v] > rate) { best = v; rate = sum[v] / n[v] }
                  print best }' "$logs/ab-q4/results.tsv")
        echo "== scripts/gpu_check.sh on ${fastest:=base}"
        # Its lines straight through (one per step as it ends), and the logs saved every half
        # minute meanwhile: on a fresh machine it can take longer than the rest of the call.
        (while sleep 30; do save_logs; done) &
        saver=$!
        LILY_GPU_DIR="$V/$fastest" scripts/gpu_check.sh "$logs/gpu-check-$fastest" 2>&1
        kill "$saver"
        save_logs
    else
        echo "== server on CUDA (base)"
        timeout 180 python3 scripts/gpu_server_check.py --lily $V/base/lily 2>&1 | tee "$logs/server.log" | tail -10
        save_logs
    fi
    echo "== 8-bit decode, one round"
    scripts/ab_decode.sh -r 1 -l "$logs/ab-q8" "${labelled[@]}" -- --synthetic --quant q8 --prompt 4096 --gen 64 \
        2>&1 | tail -$((4 + 4 * ${#variants[@]}))
    save_logs
    for name in "${variants[@]:1}"; do
        echo "== $name: CUDA tests"
        timeout 300 "$V/$name/cuda-tests" --test-threads=1 2>&1 | tee "$logs/$name-tests.log" |
            grep -E "^test .*FAILED|test result" | tail -10
        save_logs
    done
} 2>&1 | tee "$out/summary.txt"
