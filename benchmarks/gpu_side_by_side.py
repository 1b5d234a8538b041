"""The plain-PyTorch side of a GPU comparison: the project's reference GPT trained by torch's
own DistributedDataParallel or FSDP2 (`fully_shard` per block and the root), or on one GPU,
under torchrun, with the same activation checkpointing as `playground --ac` (the same
transform on the same blocks), so that a row of `playground train --backend torch` has its
peer measured on the same model, batch and machine.

    torchrun --nproc_per_node 2 benchmarks/gpu_side_by_side.py --mode ddp --model 1b --mbs 4 --ac full

DDP keeps fp32 weights and runs the model under bf16 autocast (as `playground --zero 0
--dtype bfloat16`); FSDP2 computes with bf16 parameters gathered from fp32 shards and
reduces in fp32 (`--zero 3 --reduce-dtype float32`; the committed `--zero 3` pairs ran
without that flag, reducing in bf16: half FSDP2's reduction bytes on 2 GPUs).
Prints one JSON line on rank 0: the median step after the first three, tokens/s over all
ranks, MFU (model FLOPs per token × tokens/s per GPU over the profile's peak) and CUDA's
peak allocated memory. Writes it to --json too.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from activation_checkpointing import checkpoint_blocks  # noqa: E402
from model import GPT, preset  # noqa: E402
from playground.parallelize import compile_blocks  # noqa: E402
from simulator import load_hardware  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["single", "ddp", "fsdp2"], required=True)
    ap.add_argument("--model", default="1b")
    ap.add_argument("--mbs", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ac", default="none", choices=["none", "full", "selective"])
    ap.add_argument("--compile", action="store_true", help="torch.compile each block's body (as playground --compile)")
    ap.add_argument("--hardware", default="h200", help="the profile whose peak FLOP/s MFU is taken of")
    ap.add_argument("--json")
    a = ap.parse_args()
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if a.mode != "single":
        dist.init_process_group("nccl")
    cfg = preset(a.model)
    model = GPT(cfg, seed=0, dtype=torch.float32, device="cuda")
    checkpoint_blocks(model, a.ac)
    if a.compile:
        compile_blocks(model)
    autocast = True
    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    elif a.mode == "fsdp2":
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:  # torch before 2.6
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks.values():
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        autocast = False
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    g = torch.Generator(device="cuda").manual_seed(rank)
    times = []
    for _ in range(a.steps):
        x = torch.randint(0, cfg.vocab_size, (a.mbs, cfg.seq_len + 1), device="cuda", generator=g)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.profiler.record_function("train.step"):  # benchmarks/gpu_profile.py's steady state
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[3:])
    tokens = world * a.mbs * cfg.seq_len / step
    mfu = cfg.mfu(tokens, world, load_hardware(a.hardware).peak_bf16_flops)
    out = {"side": "torch", "mode": a.mode, "model": a.model, "world": world, "mbs": a.mbs, "ac": a.ac, "compile": a.compile,
           "median_step_s": step, "tokens_per_s": tokens, "mfu": mfu,
           "cuda_peak_allocated": torch.cuda.max_memory_allocated(), "loss": loss.item()}
    if rank == 0:
        print(json.dumps(out), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f)
    if a.mode != "single":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
