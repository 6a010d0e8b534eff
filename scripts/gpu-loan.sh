#!/usr/bin/env bash
# The GPU check within a 15-minute loan: two commands of at most 10 minutes, the second sent while
# the machine is still warm (it keeps GPU_OUT, the build and the Triton cache between them).
#
# A correctness loan (the code changed since the last GPU run whose tests all passed):
#   scripts/gpu-loan.sh 1 GPU_OUT BUNDLE [SECONDS]   stage 1 without the sanitizers (install,
#                                                     requirements, the sm_90 build, bertfast info), then the
#                                                     sanitizers and ncu on each op's kernels (their first
#                                                     candidates) in a second process beside stage 2's tests
#                                                     (none of them is timed, so they may share the GPU)
#   scripts/gpu-loan.sh 2 GPU_OUT BUNDLE [SECONDS]   stage 3 (the headline, alone on the GPU, ending
#                                                     PROFILE_S=100 s early), the profile of the BERT-large
#                                                     step, then what fits of stages 4 and 5
# A speed loan (the last GPU run's tests all passed on the kernels as they are: docs/gpu-check.md):
#   scripts/gpu-loan.sh speed1 GPU_OUT BUNDLE [SECONDS]  stage 1's install, build and info; stage 3 whole
#                                                     (every case, ending PROFILE_S=180 s early); the profile;
#                                                     ncu on each op's kernels (bertfast/bench/ncu.py)
#   scripts/gpu-loan.sh speed2 GPU_OUT BUNDLE [SECONDS]  stage 4 (attention, then row ops), then what fits
#                                                     of stage 5
#
# SECONDS (default 570) is the command's own limit less the bundling: every step runs under the
# runner's --until, so the part ends in time. The logs, summary and results (not the caches) are
# bundled into BUNDLE/gpu-run.tgz after each stage. DRY=1 runs the same on CPU (--dry-run).
set -u
PART=${1:?usage: scripts/gpu-loan.sh 1|2|speed1|speed2 GPU_OUT BUNDLE [SECONDS]}
G=${2:-gpu-out}
BUNDLE=${3:-$G}
SECONDS_LEFT=${4:-570}
PY=${PYTHON:-python3}
DRY_ARG=${DRY:+--dry-run}
START=$(date +%s)
UNTIL=$(( START + SECONDS_LEFT ))
mkdir -p "$G" "$BUNDLE"

run() { "$PY" -m bertfast.gpucheck run --out "$G" --until "$UNTIL" $DRY_ARG "$@"; }
left() { echo $(( UNTIL - $(date +%s) )); }
bundle() {
    tar czf "$BUNDLE/.gpu-run.tgz" --exclude=./cache --exclude=./gpu-run.tgz --exclude=./.gpu-run.tgz -C "$G" . \
        && mv "$BUNDLE/.gpu-run.tgz" "$BUNDLE/gpu-run.tgz"
    echo "[gpu-loan] bundled $G into $BUNDLE/gpu-run.tgz at $(( $(date +%s) - START )) s"
}

# The profile runs in the stages' Triton cache (runner.py sets it for them): in a cache of its own it
# compiled and re-tuned every kernel, and the H200 run of 2026-11-27 stopped it before its first table.
profile() {
    mkdir -p "$G/profile"
    if [ -n "${DRY:-}" ]; then
        prof=(--device cpu --model tiny --seqlen 32 --batch 4)
    else
        prof=()
    fi
    TRITON_CACHE_DIR="$G/cache/triton" timeout $(( $(left) - 30 )) "$PY" -m bertfast.bench.profile "${prof[@]}" \
        --trace --out "$G/profile" > "$G/profile/profile.log" 2>&1
    echo "[gpu-loan] profile: exit $?"
    cat "$G/profile/summary.txt" 2>/dev/null
    bundle
}
# ncu on one training forward and backward of each op (bertfast/bench/ncu.py), in the stages' cache:
# alone on the GPU and autotuned (a speed loan), or, with "beside", beside stage 2's tests at each
# kernel's first candidate (autotuning there would time candidates on a shared GPU) and not bundled
# (the part bundles once the tests end). Then, while a minute is left, the attention target's kernels
# at seq 512 (--set attention-512) into $G/ncu/attention-512.
BESIDE_NOTE="Taken beside the GPU check's tests (a correctness loan's first part): the tests' kernels are \
small and mostly wait on their compiles, but the times and DRAM rates may include slices of theirs; a speed \
loan's ncu, alone on the GPU and autotuned, is the clean one."
ncu_kernels() {
    mkdir -p "$G/ncu"
    if [ -n "${DRY:-}" ]; then
        echo "[gpu-loan] ncu: not on a CPU dry run (the target alone: python -m bertfast.bench.ncu --target --dry-run)"
        return
    fi
    local autotune=${BERTFAST_AUTOTUNE:-1} note="" margin=15 how=""
    if [ "${1:-}" = beside ]; then
        autotune=0 note=$BESIDE_NOTE margin=20 how=" (beside the tests, first candidates)"
    fi
    BERTFAST_AUTOTUNE=$autotune TRITON_CACHE_DIR="$G/cache/triton" timeout $(( $(left) - margin )) "$PY" \
        -m bertfast.bench.ncu --out "$G/ncu" --note "$note" > "$G/ncu/ncu.log" 2>&1
    echo "[gpu-loan] ncu$how: exit $?"
    if [ "$(left)" -ge $(( margin + 60 )) ]; then
        mkdir -p "$G/ncu/attention-512"
        BERTFAST_AUTOTUNE=$autotune TRITON_CACHE_DIR="$G/cache/triton" timeout $(( $(left) - margin )) "$PY" \
            -m bertfast.bench.ncu --set attention-512 --out "$G/ncu/attention-512" --note "$note" \
            > "$G/ncu/attention-512/ncu.log" 2>&1
        echo "[gpu-loan] ncu --set attention-512$how: exit $?"
    else
        echo "[gpu-loan] not run: ncu --set attention-512 ($(left) s left)"
    fi
    if [ "${1:-}" = beside ]; then
        return  # the part prints the ncu.md files and bundles once the tests end
    fi
    cat "$G/ncu/ncu.md" "$G/ncu/attention-512/ncu.md" 2>/dev/null
    bundle
}
# What runs beside stage 2's tests in a correctness loan's first part: the sanitizers, then ncu while
# a minute is left (expected to take about two: the kernels' compiles and their replays).
beside_tests() {
    run --stage 1 --step memcheck --step racecheck > "$G/sanitizers.out" 2>&1
    if [ "$(left)" -ge 60 ]; then
        ncu_kernels beside
    else
        echo "[gpu-loan] not run: ncu ($(left) s left)"
    fi
}
# Stage 3, ending PROFILE_S early where the part has time for both, then the profile.
headline_and_profile() {
    local part_until=$UNTIL
    if [ "$(left)" -ge $(( PROFILE_S + 120 )) ]; then
        UNTIL=$(( UNTIL - PROFILE_S ))
    fi
    run --stage 3
    UNTIL=$part_until
    bundle
    if [ "$(left)" -ge 90 ]; then
        profile
    fi
}
# The autotune candidates stage 2's tests found wrong (tests/ops/test_candidates.py): the runner leaves
# them out of its stages itself; exported here for what runs outside it (the profile, ncu).
exclude_wrong_candidates() {
    local wrong
    wrong=$("$PY" -c 'import sys; from bertfast.gpucheck.runner import wrong_candidates
print(wrong_candidates(sys.argv[1]))' "$G")
    if [ -n "$wrong" ] && [ -z "${BERTFAST_EXCLUDE_CANDIDATES:-}" ]; then
        export BERTFAST_EXCLUDE_CANDIDATES="$wrong"
        echo "[gpu-loan] leaving out the autotune candidates stage 2 found wrong: $BERTFAST_EXCLUDE_CANDIDATES"
    fi
}
# What both loans run of stages 4 and 5 once the headline is in, in this order
KERNEL_STEPS=("4 attention" "4 row-ops" "5 mlm-head" "5 finetune-inference" "5 compiled")
# run_while_time STAGE STEP...: each "STAGE STEP" pair while a minute is left
run_while_time() {
    for part in "$@"; do
        set -- $part
        if [ "$(left)" -ge 60 ]; then
            run --stage "$1" --step "$2"
            bundle
        else
            echo "[gpu-loan] not run: stage $1 $2 ($(left) s left)"
        fi
    done
}

case "$PART" in
1)
    run --stage 1 --skip memcheck --skip racecheck
    beside_tests > "$G/beside.out" 2>&1 &
    beside=$!
    run --stage 2
    wait $beside
    cat "$G/sanitizers.out" "$G/beside.out" "$G/ncu/ncu.md" "$G/ncu/attention-512/ncu.md" 2>/dev/null
    bundle
    ;;
2)
    exclude_wrong_candidates
    # The profile is this part's second aim: stage 3 stops starting cases in time to leave it
    # PROFILE_S (the H100 run of 2026-11-26 spent a 300 s part on stage 3's four cases).
    PROFILE_S=${PROFILE_S:-100}
    headline_and_profile
    run_while_time "${KERNEL_STEPS[@]}"
    ;;
speed1)
    exclude_wrong_candidates
    run --stage 1 --step install --step requirements --step build --step info --step mma-rate
    PROFILE_S=${PROFILE_S:-180}
    headline_and_profile
    if [ "$(left)" -ge 60 ]; then
        ncu_kernels
    else
        echo "[gpu-loan] not run: ncu ($(left) s left)"
    fi
    ;;
speed2)
    exclude_wrong_candidates
    run_while_time "${KERNEL_STEPS[@]}"
    ;;
*)
    echo "gpu-loan: PART must be 1 or 2 (a correctness loan) or speed1 or speed2 (a speed loan), got $PART" >&2
    exit 2
    ;;
esac
cat "$G/summary.md"
