# Sourced by the GPU run scripts: the environment every torchrun of this project uses on the
# lent machines (NVLink multicast off: the device tool's notes), $OUT and $LOGS, and
# run NAME NPROC TIMEOUT PLAYGROUND-ARGS...: one `playground` command under torchrun on the
# torch backend (LAUNCH, if set, in place of `-m playground`: benchmarks/with_inductor.py's), its log in $LOGS/NAME.log, a one-line verdict printed, and every log
# packed into $OUT/gpu_logs.tgz after each run (the device tool brings back few files);
# device_profile NAME PLAYGROUND-TRAIN-ARGS...: one such run with the device alone recorded;
# one_gpu_host: the GPU and the host's CPU written to $LOGS/gpus.txt, $gpu set to h100 or h200;
# calibrate GPU MODEL MICRO-BATCH: `playground calibrate` on one GPU from GPU's datasheet
# (h100 or h200), its profile in $LOGS/GPU-MODEL.json, its floors printed.
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu_run}; LOGS=${LOGS:-/tmp/gpu_logs}; mkdir -p "$OUT" "$LOGS"
run() {
  local name=$1 n=$2 t=$3; shift 3
  local quiet=--no-progress; [ "$1" = check ] && quiet=  # (a check shows no progress bar, and refuses the flag)
  timeout "$t" torchrun --nproc_per_node "$n" ${LAUNCH:--m playground} "$@" --backend torch $quiet 2>&1 | grep -v "^W1" \
    > "$LOGS/$name.log"
  echo "== $name (exit ${PIPESTATUS[0]}): $(grep -E 'PASS|FAIL|throughput|measured peak|Error|error' "$LOGS/$name.log" | head -3 | tr '\n' ' ')"
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
}
device_profile() {  # name, playground train args...: one GPU, bf16, micro-batch 4, 12 steps (the args may say
  # otherwise), the device alone
  # recorded by CUPTI over steps 6-10 (benchmarks/gpu_profile.py --device-only), the train JSON beside it
  local name=$1; shift
  timeout 300 torchrun --nproc_per_node 1 benchmarks/gpu_profile.py --out "$LOGS" --name "$name" --side playground \
    --device-only --skip 4 --last 5 -- train --dtype bfloat16 --steps 12 --micro-batch-size 4 "$@" --backend torch \
    --no-progress --json "$LOGS/$name.json" 2>&1 | grep -v "^W1" > "$LOGS/$name.log"
  echo "== $name: $(grep -h 'throughput\|device only' "$LOGS/$name.log" "$LOGS/$name.txt" 2>/dev/null | tr '\n' ' ')"
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
}
calibrate() {  # gpu, model, micro-batch
  timeout 240 torchrun --nproc_per_node 1 -m playground calibrate --backend torch --model "$2" --micro-batch-size "$3" \
    --base "$1-datasheet" --name "$1-$2" --out "$LOGS/$1-$2.json" 2>&1 | grep -v "^W1" > "$LOGS/calibrate-$2.log"
  echo "== calibrate $2 (exit ${PIPESTATUS[0]}): $(grep -E '_floor|fraction' "$LOGS/calibrate-$2.log" | cut -c1-200 | tr '\n' ' ')"
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
}
one_gpu_host() {
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOGS/gpus.txt"
  lscpu | grep -E "Model name|^CPU\(s\)" >> "$LOGS/gpus.txt"
  case $(head -1 "$LOGS/gpus.txt") in *H100*) gpu=h100 ;; *) gpu=h200 ;; esac
}
