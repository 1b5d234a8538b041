# Sourced by the GPU run scripts: the environment every torchrun of this project uses on the
# lent machines (NVLink multicast off: the device tool's notes), $OUT and $LOGS, and
# run NAME NPROC TIMEOUT PLAYGROUND-ARGS...: one `playground` command under torchrun on the
# torch backend (LAUNCH, if set, in place of `-m playground`: benchmarks/with_inductor.py's), its log in $LOGS/NAME.log, a one-line verdict printed, and every log
# packed into $OUT/gpu_logs.tgz after each run (the device tool brings back few files).
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu_run}; LOGS=${LOGS:-/tmp/gpu_logs}; mkdir -p "$OUT" "$LOGS"
run() {
  local name=$1 n=$2 t=$3; shift 3
  timeout "$t" torchrun --nproc_per_node "$n" ${LAUNCH:--m playground} "$@" --backend torch --no-progress 2>&1 | grep -v "^W1" \
    > "$LOGS/$name.log"
  echo "== $name (exit ${PIPESTATUS[0]}): $(grep -E 'PASS|FAIL|throughput|measured peak|Error|error' "$LOGS/$name.log" | head -3 | tr '\n' ' ')"
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
}
