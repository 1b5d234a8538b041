"""Whether a waited NCCL Work keeps its call's buffers alive, on one GPU.

moe/dispatch.py overlaps the MoE combine's all-to-all with the shared experts and keeps the
call's Work between its start and its wait; it kept it, waited, until backward. In the
simulator that Work holds the send buffer (1b-dsmoe at ep 2: 64 MiB a layer). This measures
what a torch Work on NCCL holds: a world of one rank (the call still runs through NCCL), an
async all_to_all_single of 64 MiB waited, then `torch.cuda.memory_allocated` over the
buffers' first allocation with the caller's references dropped, while the Work lives and
after it is deleted; the same for all_reduce.

    python benchmarks/work_buffers_gpu.py [--json F]
"""
import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import print_table, write_json  # noqa: E402

MiB = 2 ** 20


def held(call: str, n: int) -> dict:
    """MiB allocated beyond before the call: with the Work alive (the caller's tensors
    dropped), and after the Work is deleted."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    x = torch.ones(n // 2, dtype=torch.bfloat16, device="cuda")
    if call == "all_to_all_single":
        out = torch.empty_like(x)
        work = dist.all_to_all_single(out, x, async_op=True)
    else:
        out = x
        work = dist.all_reduce(x, async_op=True)
    work.wait()
    torch.cuda.synchronize()
    del x, out
    with_work = torch.cuda.memory_allocated() - before
    del work
    torch.cuda.synchronize()
    return {"call": call, "buffers_mib": (2 if call == "all_to_all_single" else 1) * n / MiB,
            "with_work_mib": with_work / MiB, "after_mib": (torch.cuda.memory_allocated() - before) / MiB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    rows = [held(call, 64 * MiB) for call in ("all_to_all_single", "all_reduce")]
    dist.destroy_process_group()
    print_table(f"MiB a waited Work keeps (one rank on NCCL; {torch.cuda.get_device_name()}, torch {torch.__version__})",
                ["call", "its buffers", "held while the Work lives", "held after it is deleted"],
                [[r["call"], f"{r['buffers_mib']:.0f}", f"{r['with_work_mib']:.0f}", f"{r['after_mib']:.0f}"] for r in rows])
    if a.json:
        write_json(a.json, {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
