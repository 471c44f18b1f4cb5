#!/bin/sh
# gpu-check.sh - the CUDA backend's checks, for a machine with a GPU.
#
#   kernels/cuda/gpu-check.sh            (from anywhere; takes no arguments)
#
# Environment: FEDINFER_MODEL (default: models/SmolLM2-135M-Instruct.Q4_1.gguf
# under the repository; examples/setup.sh fetches it), BUILD (default
# build-gpu under the repository), JOBS (default: all cores), NO_BUILD=1
# (skip step 1 and use the binaries already in BUILD: fedinfer,
# libfi_cuda.so and fi_cuda_probe at its top, the tests in BUILD/tests; for
# a GPU machine without the project's build dependencies, with binaries
# built elsewhere against the same CUDA major version), LIMIT_MAX (caps each
# step's time limit, in seconds), LOG (default BUILD/gpu-check.log).
#
# Without the model file (a machine that cannot download it), the steps
# after the tests use a random-weight model of the same shapes and types
# written by fi_cuda_probe --write-synthetic: timings are representative,
# the text is not. test_cuda then runs the model end to end on its own
# small synthetic model only, and says that the default model was absent.
#
# Steps, each under its own time limit so the whole run stays under five
# minutes on an H100/H200-class machine:
#   1. build with -DFEDINFER_CUDA=ON (only the targets below)
#   2. test_cuda: every kernel against the CPU backend on fresh random
#      inputs with poisoned outputs, and the model end to end against the
#      CPU backend (greedy tokens and logits), in both weight modes
#   3. test_nccl: the NCCL all-reduce (skipped with fewer than 2 GPUs);
#      group_gpu_check: a TP=2 shard group on the GPU(s) against the CPU
#   4. fedinfer run, greedy, --device cuda and --device cpu (--act-bits 16),
#      same prompt
#   5. fedinfer bench --device cuda
#   6. fi_cuda_probe: cuBLASLt throughput at the model's shapes against the
#      measured peak, prefill 2048, decode batch 1 (wall time per token
#      against summed kernel time), 32-token steps
#   7. fedinfer bench --serve: the scheduler at 1, 8 and 32 concurrent
#      requests (aggregate tokens/s, TTFT and TPOT)
#   8. with MEMCHECK=1: test_cuda under compute-sanitizer's memcheck and
#      racecheck (slow: minutes)
# and prints a summary. Exit status 0 only when every step passed; a machine
# without a device fails at step 2 (a GPU check that ran on no GPU is not a
# pass).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${BUILD:-$root/build-gpu}
model=${FEDINFER_MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
jobs=${JOBS:-$(nproc 2>/dev/null || echo 4)}
log=${LOG:-$build/gpu-check.log}
summary=""
failed=0
t_all=$(date +%s)

step() { # step NAME LIMIT_S COMMAND...: runs, logs, records the result
    name=$1 limit=$2
    shift 2
    # LIMIT_MAX (seconds) caps every step's limit, for short leases
    [ -n "${LIMIT_MAX:-}" ] && [ "$limit" -gt "$LIMIT_MAX" ] && limit=$LIMIT_MAX
    t0=$(date +%s)
    echo "=== $name" | tee -a "$log"
    timeout "$limit" "$@" >>"$log" 2>&1
    rc=$?
    dt=$(($(date +%s) - t0))
    case $rc in
    0) res=ok ;;
    77) res=skipped ;;
    124) res="TIMEOUT (${limit}s)"; failed=1 ;;
    *) res="FAILED (exit $rc)"; failed=1 ;;
    esac
    summary="$summary$(printf '%-12s %-22s %4ds' "$name" "$res" "$dt")
"
    echo "=== $name: $res in ${dt}s" | tee -a "$log"
    return $rc
}

mkdir -p "$build"
: >"$log"
# the binaries open the CUDA module by this path first (else beside the
# executable, else the path it was built at)
export FEDINFER_CUDA_MODULE=${FEDINFER_CUDA_MODULE:-$build/libfi_cuda.so}
synthetic=0
if [ ! -r "$model" ]; then
    echo "gpu-check: model $model is missing; using a synthetic model of its shapes" | tee -a "$log"
    synthetic=1
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L | tee -a "$log"

if [ "${NO_BUILD:-0}" = 1 ]; then
    for f in fedinfer libfi_cuda.so fi_cuda_probe tests/test_cuda tests/test_nccl tests/group_gpu_check; do
        [ -e "$build/$f" ] || { echo "gpu-check: NO_BUILD=1 but $build/$f is missing" | tee -a "$log"; exit 1; }
    done
else
    step build 240 sh -c "cmake -S '$root' -B '$build' -DFEDINFER_CUDA=ON \
        -DFEDINFER_DEFAULT_MODEL='$model' -DCMAKE_BUILD_TYPE=Release &&
      cmake --build '$build' -j '$jobs' --target fedinfer test_cuda test_nccl fi_cuda_probe group_gpu_check" || {
        tail -30 "$log"
        exit 1
    }
fi
if [ "$synthetic" = 1 ]; then
    model=$build/synthetic.gguf
    "$build/fi_cuda_probe" --write-synthetic "$model" || exit 1
fi
export FEDINFER_MODEL="$model" # test_cuda's default-model tests read it
step test_cuda 120 "$build/tests/test_cuda"
if [ "$rc" = 77 ]; then
    summary="${summary}(test_cuda skipped: no device; this is not a pass)
"
    failed=1
fi
step test_nccl 60 "$build/tests/test_nccl"
step group 90 "$build/tests/group_gpu_check" "$model"
prompt="Write one sentence about the sea."
step run_cuda 60 sh -c "'$build/fedinfer' run -m '$model' --device cuda --temp 0 -n 48 --stats '$prompt' >'$build/run_cuda.txt'"
# the CPU at --act-bits 16, its most exact products: the GPU's fp16
# activations are closer to that than to the default 12 bits, and this
# prompt has a near tie (',' or '.' after "in its own way") that the
# default CPU run takes the other way
step run_cpu 60 sh -c "'$build/fedinfer' run -m '$model' --device cpu --act-bits 16 --temp 0 -n 48 '$prompt' >'$build/run_cpu.txt'"
if cmp -s "$build/run_cuda.txt" "$build/run_cpu.txt"; then
    same="identical"
else
    same="DIFFERENT (allowed only after a near tie; test_cuda checks that)"
fi
step bench 90 "$build/fedinfer" bench -m "$model" --device cuda -r 3 --prompt-tokens 512 --gen-tokens 128 --ctx 2048
step probe 120 "$build/fi_cuda_probe" "$model"
step serve 90 "$build/fedinfer" bench --serve -m "$model" --device cuda --only concurrency \
    --concurrency 1,8,32 --prompt-tokens 64 --gen-tokens 64
# MEMCHECK=1: test_cuda again under compute-sanitizer (out-of-bounds and
# misaligned accesses, uninitialised reads of device memory)
if [ "${MEMCHECK:-0}" = 1 ]; then
    step memcheck 240 compute-sanitizer --tool memcheck --error-exitcode 3 "$build/tests/test_cuda"
    # shared-memory races: the attention tests (their kernels share the most)
    step racecheck 120 env FI_TEST_FILTER='test_att*' compute-sanitizer --tool racecheck \
        --error-exitcode 3 "$build/tests/test_cuda"
fi

echo
echo "--- test_cuda (parity: error / bound; model: cosine, logit diff, greedy agreement)"
sed -n '/^=== test_cuda$/,/^=== test_cuda:/p' "$log" |
    grep -E 'rel err|cos |identical|near tie|differ|argmax|SKIPPED|FAILED|PASSED|error:' | head -150
echo
echo "--- test_nccl"
sed -n '/^=== test_nccl$/,/^=== test_nccl:/p' "$log" | grep -E 'device|SKIPPED|FAILED|PASSED'
echo
echo "--- group_gpu_check"
sed -n '/^=== group$/,/^=== group:/p' "$log" | grep -v '^==='
echo
echo "--- greedy text, cuda vs cpu (--act-bits 16): $same"
echo "cuda: $(cat "$build/run_cuda.txt")"
echo "cpu:  $(cat "$build/run_cpu.txt")"
echo
echo "--- bench --device cuda"
sed -n '/^=== bench$/,/^=== bench:/p' "$log" | grep -v '^==='
echo
echo "--- probe"
grep '^|' "$log"
echo
echo "--- serving: continuous batching on the GPU (decode batch 1 vs 8 vs 32)"
sed -n '/^=== serve$/,/^=== serve:/p' "$log" | grep -v '^==='
if [ "${MEMCHECK:-0}" = 1 ]; then
    echo
    echo "--- compute-sanitizer"
    grep -E '^========= (ERROR SUMMARY|RACECHECK SUMMARY)' "$log"
fi

echo
echo "--- steps"
printf '%s' "$summary"
[ "$synthetic" = 1 ] && echo "model: SYNTHETIC (random weights, SmolLM2-135M shapes); the default model was absent"
echo "total $(($(date +%s) - t_all))s; full log: $log"
exit $failed
