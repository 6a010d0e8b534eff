#!/usr/bin/env bash
# The GPU check within a 15-minute loan: two commands of at most 10 minutes, the second sent while
# the machine is still warm (it keeps GPU_OUT, the build and the Triton cache between them).
#
#   scripts/gpu-loan.sh 1 GPU_OUT BUNDLE [SECONDS]   correctness: stage 1 without the sanitizers (install,
#                                                     requirements, the sm_90 build, bertfast info), then the
#                                                     sanitizers in a second process beside stage 2's tests
#                                                     (neither is timed, so they may share the GPU)
#   scripts/gpu-loan.sh 2 GPU_OUT BUNDLE [SECONDS]   speed: stage 3 (the headline, alone on the GPU, ending
#                                                     PROFILE_S=100 s early), the profile of the BERT-large
#                                                     step, then what fits of stages 4 and 5
#
# SECONDS (default 570) is the command's own limit less the bundling: every step runs under the
# runner's --until, so the part ends in time. The logs, summary and results (not the caches) are
# bundled into BUNDLE/gpu-run.tgz after each stage. DRY=1 runs the same on CPU (--dry-run).
set -u
PART=${1:?usage: scripts/gpu-loan.sh 1|2 GPU_OUT BUNDLE [SECONDS]}
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

case "$PART" in
1)
    run --stage 1 --skip memcheck --skip racecheck
    run --stage 1 --step memcheck --step racecheck > "$G/sanitizers.out" 2>&1 &
    sanitizers=$!
    run --stage 2
    wait $sanitizers
    cat "$G/sanitizers.out"
    bundle
    ;;
2)
    # The profile is this part's second aim: stage 3 stops starting cases in time to leave it
    # PROFILE_S (the H100 run of 2026-11-26 spent a 300 s part on stage 3's four cases).
    PROFILE_S=${PROFILE_S:-100}
    PART_UNTIL=$UNTIL
    if [ "$(left)" -ge $(( PROFILE_S + 120 )) ]; then
        UNTIL=$(( UNTIL - PROFILE_S ))
    fi
    run --stage 3
    UNTIL=$PART_UNTIL
    bundle
    if [ "$(left)" -ge 90 ]; then
        mkdir -p "$G/profile"
        if [ -n "${DRY:-}" ]; then
            prof=(--device cpu --model tiny --seqlen 32 --batch 4)
        else
            prof=()
        fi
        timeout $(( $(left) - 30 )) "$PY" -m bertfast.bench.profile "${prof[@]}" --trace --out "$G/profile" \
            > "$G/profile/profile.log" 2>&1
        echo "[gpu-loan] profile: exit $?"
        cat "$G/profile/summary.txt" 2>/dev/null
        bundle
    fi
    for part in "4 attention" "4 row-ops" "5 mlm-head" "5 finetune-inference" "5 compiled"; do
        set -- $part
        if [ "$(left)" -ge 60 ]; then
            run --stage "$1" --step "$2"
            bundle
        else
            echo "[gpu-loan] not run: stage $1 $2 ($(left) s left)"
        fi
    done
    ;;
*)
    echo "gpu-loan: PART must be 1 (correctness) or 2 (speed), got $PART" >&2
    exit 2
    ;;
esac
cat "$G/summary.md"
