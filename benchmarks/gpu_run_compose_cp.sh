#!/usr/bin/env bash
# GPU run on a 2-GPU machine for the composed strategies and context parallelism: the
# equivalence checks on NCCL (context parallelism ring and Ulysses in float32, ring in bf16
# on the flash-attention kernels, cp × ZeRO-3, and the earlier layouts again after the
# composition refactor), then the 1b preset in bf16 at long sequences on one GPU (cp 1)
# and on two (cp 2), tokens/s and CUDA peak memory. Logs and JSON in $LOGS, packed after
# every run into $OUT/gpu_logs.tgz (the device tool brings back few files).
set -uo pipefail
# (first run, 2026-11-30: the bf16 ring check failed with non-contiguous chunks passed to
# the flash kernels, and float32 checks failed on weights by 2-13% of the tolerance with
# gradient errors under 1.2e-6: AdamW's amplification of float32 rounding; logs kept)
source benchmarks/gpu_common.sh  # the environment, $OUT, $LOGS and run()
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$LOGS/gpus.txt"; python3 -c 'import torch; print(torch.__version__)' >> "$LOGS/gpus.txt"
S="--model small --microbatches 2 --micro-batch-size 2"
# float64 on the GPUs: the check's 1e-10 tolerance, no float32-AdamW noise in the verdict
for d in ${CHECK_DTYPES:-float64}; do
  run check_cp2_ring_$d        2 150 check $S --cp 2 --dtype $d
  run check_cp2_ring_contig_$d 2 150 check $S --cp 2 --cp-balance contiguous --dtype $d
  run check_cp2_ulysses_$d     2 150 check $S --cp 2 --cp-impl ulysses --dtype $d
  run check_cp2_zero3_$d       2 150 check $S --cp 2 --zero 3 --dtype $d
  run check_tp2_sp_$d          2 150 check $S --tp 2 --sp --dtype $d
  run check_pp2_zero1_zb1_$d   2 150 check $S --pp 2 --microbatches 4 --schedule zb1 --zero 1 --dtype $d
done
run check_cp2_ring_bf16        2 150 check $S --cp 2 --dtype bfloat16 --seq-len 1024  # the flash-attention blocks
L="--model 1b --dtype bfloat16 --micro-batch-size 1 --steps ${STEPS:-4}"
for seq in ${SEQS1:-32768 49152}; do run train_1b_cp1_s$seq 1 280 train $L --seq-len $seq --json "$LOGS/train_1b_cp1_s$seq.json"; done
for seq in ${SEQS2:-65536 98304}; do run train_1b_cp2_s$seq 2 280 train $L --cp 2 --seq-len $seq --json "$LOGS/train_1b_cp2_s$seq.json"; done
