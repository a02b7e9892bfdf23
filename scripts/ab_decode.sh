#!/usr/bin/env bash
# Decode speed of several builds or settings, measured in turn within one run on the GPU machine.
# The spread between device calls (clocks, temperature, the machine lent) is as large as the
# differences worth measuring, so variants are only compared within one run: each round runs
# every variant once, every other round in reverse order, after one warm-up run each that is not
# counted (it also compiles the variant's kernels into the cache).
#   scripts/ab_decode.sh [-r ROUNDS] [-l LOG_DIR] LABEL=COMMAND... [-- BENCH_ARGS...]
# COMMAND starts lily (a binary, optionally behind `env NAME=VALUE ...`, as the shell reads it); it
# is given `bench` and BENCH_ARGS (default: --synthetic --quant q4 --prompt 4096 --gen 64).
# Prints each run's decode lines, then per variant the mean, lowest and highest tok/s (and, with
# --critical-path in BENCH_ARGS, of the replayed step's time and each kernel's time per launch).
# Stopped by SIGTERM or SIGINT (e.g. `timeout` running out), it prints that table for the runs
# that finished and exits with 124, so a device call cut short still brings back what it measured.
# Example (a build of HEAD against one of an earlier commit, and a kernel define):
#   scripts/ab_decode.sh -r 2 old=target/gpu-old/lily new=target/gpu/lily \
#       'ahead=env LILY_DEFINES="MOE_DOWN_STAGE_AHEAD=2" target/gpu/lily' -- --synthetic --gen 64
set -uo pipefail
rounds=2
log=/tmp/lily-ab
while getopts "r:l:" opt; do
    case "$opt" in
        r) rounds="$OPTARG" ;;
        l) log="$OPTARG" ;;
        *) exit 2 ;;
    esac
done
shift $((OPTIND - 1))
labels=()
commands=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    case "$1" in
        *=*) labels+=("${1%%=*}") && commands+=("${1#*=}") ;;
        *) echo "ab_decode.sh: a variant is LABEL=COMMAND, got '$1'" >&2 && exit 2 ;;
    esac
    shift
done
[ "${1:-}" = "--" ] && shift
bench_args=("$@")
[ ${#bench_args[@]} -eq 0 ] && bench_args=(--synthetic --quant q4 --prompt 4096 --gen 64)
if [ ${#labels[@]} -eq 0 ]; then
    echo "ab_decode.sh: no variants given" >&2
    exit 2
fi
if ! [[ "$rounds" =~ ^[1-9][0-9]*$ ]]; then
    echo "ab_decode.sh: ROUNDS must be a positive whole number, got '$rounds'" >&2
    exit 2
fi
mkdir -p "$log"
results="$log/results.tsv"
: >"$results"
status=0

# Per variant and measure: runs, mean, lowest and highest of the results so far.
summarise() {
    echo
    printf '%-24s %-26s %5s %9s %9s %9s\n' variant measure runs mean lowest highest
    awk -F'\t' '
        { key = $1 "\t" $2; if (!(key in n)) order[++keys] = key
          n[key]++; sum[key] += $3
          if (!(key in lo) || $3 < lo[key]) lo[key] = $3
          if (!(key in hi) || $3 > hi[key]) hi[key] = $3 }
        END { for (k = 1; k <= keys; k++) { key = order[k]; split(key, p, "\t")
              printf "%-24s %-26s %5d %9.2f %9.2f %9.2f\n", p[1], p[2], n[key], sum[key] / n[key], lo[key], hi[key] } }
    ' "$results"
}

# To the script's own stdout (descriptor 3): a signal's trap runs inside the redirection of the
# run it stopped.
exec 3>&1
stopped() {
    {
        echo "ab_decode.sh: stopped by a signal; the runs that finished:"
        summarise
    } >&3
    exit 124
}
trap stopped TERM INT

# Runs variant $1 with BENCH_ARGS, its output in $log/$2.log.
run() {
    eval "${commands[$1]}" bench '"${bench_args[@]}"' >"$log/$2.log" 2>&1
}

for i in "${!labels[@]}"; do
    if ! run "$i" "${labels[$i]}-warmup"; then
        echo "FAILED warm-up of ${labels[$i]} (see $log/${labels[$i]}-warmup.log)"
        tail -n 20 "$log/${labels[$i]}-warmup.log"
        status=1
    fi
done
for ((r = 1; r <= rounds; r++)); do
    order=("${!labels[@]}")
    if ((r % 2 == 0)); then
        order=()
        for ((k = ${#labels[@]} - 1; k >= 0; k--)); do order+=("$k"); done
    fi
    for i in "${order[@]}"; do
        name="${labels[$i]}-$r"
        if ! run "$i" "$name"; then
            echo "FAILED $name (see $log/$name.log)"
            tail -n 20 "$log/$name.log"
            status=1
            continue
        fi
        grep -E "^decode +[0-9.]+ tok/s|^decode (batch [0-9]+|sampled) .*tok/s" "$log/$name.log" | sed "s/^/$name  /"
        # Rates as lily bench prints them (`decode  X tok/s ... (...; Y tok/s with each id read
        # back ...)`, the second the steps one at a time; `decode sampled  X tok/s` with
        # --temperature; `decode batch N  X tok/s in all`), and with --critical-path the
        # one-sequence step's replayed time and each kernel's microseconds per launch
        # (`  NAME N launches X us Y us each Z%`).
        awk -v label="${labels[$i]}" '
            function out(kind, value) { printf "%s\t%s\t%s\n", label, kind, value }
            /^decode +[0-9.]+ tok\/s/ {
                out("one sequence", $2)
                if (match($0, /; [0-9.]+ tok\/s with each id read back/))
                    out("one sequence, stepwise", substr($0, RSTART + 2) + 0)
                next }
            /^decode sampled +[0-9.]+ tok\/s/ { out("one sequence, sampled", $3); next }
            /^decode batch [0-9]+ / && /tok\/s/ && !/critical/ { out("batch " $3, $4); next }
            /^decode critical path, per kernel/ {
                critical = 1; match($0, /step [0-9.]+ us/)
                out("step us", substr($0, RSTART + 5, RLENGTH - 8)); next }
            critical && /^  / { out("us " $1, $6); next }
            { critical = 0 }
        ' "$log/$name.log" >>"$results"
    done
done
summarise
exit "$status"
