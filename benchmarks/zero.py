"""Benchmark: ZeRO stages 0-3 at dp = 8 on the small GPT. Per rank:
model-state memory by category (measured from the tensors each rank holds after a step,
the gradients of stages 2-3 as the step's backward made them: the step frees them) beside
the ZeRO paper's mixed-precision formulas (2 + 2 + 12 bytes per parameter: stage 0 16Ψ,
1 4Ψ + 12Ψ/N, 2 2Ψ + 14Ψ/N, 3 16Ψ/N; this stage 3 keeps no bf16 partition of the
parameters, as FSDP2: 14Ψ/N), the peak of the communication buffers (the
gathered units and in-flight gradients the formulas leave out), the peak of activations,
and the bytes sent per step from the ledger beside 2Ψ(N-1)/N (stages 0-2) and 3Ψ(N-1)/N
(stage 3) elements of bf16; with the simulated step on h100-datasheet. Prints a table and writes
JSON.
"""
import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
from collectives import launch  # noqa: E402
from simulator import MemoryTracker, SimulatedTime  # noqa: E402
from model import GPT, preset  # noqa: E402
from playground.report import human_bytes  # noqa: E402
from zero import ZeroDataParallel  # noqa: E402

N = 8
STEPS = 3


def rank_program(world, stage, batch):
    cfg = preset("small")
    memory = world.instruments.memory = MemoryTracker()  # the rank's, which the engine reports to
    model = GPT(cfg, seed=0, dtype=torch.float32)
    z = ZeroDataParallel(model, world, stage, units=list(model.blocks.values()), lr=1e-3,
                         compute_dtype=torch.bfloat16)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(world.rank)
    times = []
    for step in range(STEPS):
        t0 = world.timing.clock.now
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
        with memory.track_activations(exclude=params):
            loss = z(x[:, :-1], x[:, 1:])
            loss.backward()
        del loss
        z.step()
        times.append(world.timing.clock.now - t0)
    report = memory.snapshot(states=MemoryTracker.measure(z.state_tensors()))
    states = {k: report[k] for k in ("parameters", "gradients", "optimizer")}
    return {"states": states, "peak_comm": memory.peak_comm_buffers,
            "peak_act": memory.peak_activations, "step_s": times[-1]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--json", default=default_json("zero"))
    args = ap.parse_args()
    psi = sum(p.numel() for p in GPT(preset("small"), device="meta").parameters())
    formula = {0: (2 * psi, 2 * psi, 12 * psi), 1: (2 * psi, 2 * psi, 12 * psi / N),
               2: (2 * psi, 2 * psi / N, 12 * psi / N), 3: (2 * psi / N, 2 * psi / N, 12 * psi / N)}
    rows, out = [], {}
    for stage in range(4):
        res = launch(rank_program, N, args=(stage, args.batch), time_model=SimulatedTime("h100-datasheet"))
        v = res.values[0]
        s = v["states"]
        total = s["parameters"] + s["gradients"] + s["optimizer"]
        f = formula[stage]
        sent = sum(e.bytes_sent for e in res.ledger.for_rank(0)) / STEPS
        expect_sent = (3 if stage == 3 else 2) * psi * (N - 1) / N * 2
        algorithms = sorted({e.algorithm for e in res.ledger.for_rank(0) if e.label.startswith("zero.grads")})
        rows.append([stage, f"{human_bytes(s['parameters'])} / {human_bytes(f[0])}",
                     f"{human_bytes(s['gradients'])} / {human_bytes(f[1])}",
                     f"{human_bytes(s['optimizer'])} / {human_bytes(f[2])}",
                     f"{human_bytes(total)} / {human_bytes(sum(f))}", human_bytes(v["peak_comm"]),
                     human_bytes(v["peak_act"]), f"{human_bytes(sent)} / {human_bytes(expect_sent)}",
                     ", ".join(algorithms), f"{v['step_s'] * 1e3:.3f} ms"])
        out[stage] = {**s, "model_states": total, "formula": dict(zip(("parameters", "gradients", "optimizer"), f)),
                      "peak_comm_buffers": v["peak_comm"], "peak_activations": v["peak_act"],
                      "bytes_sent_per_step": sent, "formula_bytes_per_step": expect_sent,
                      "simulated_step_s": v["step_s"], "grad_algorithms": algorithms}
    print_table(f"ZeRO at dp={N}, small GPT (Ψ = {psi:,} parameters), bf16 compute / fp32 master, "
                f"{args.batch} sequences per rank; per rank, measured / formula",
                ["stage", "parameters", "gradients", "optimizer", "model states", "comm buffers (peak)",
                 "activations (peak)", "sent per step", "grads reduced by", "step on h100-datasheet"], rows)
    print("sent per step: the formula counts ring algorithms; the cost model picks recursive doubling where it is "
          "faster (small all-reduces), and the ledger records that algorithm's bytes")
    write_json(args.json, {"world": N, "psi": psi, "batch": args.batch, "stages": out})


if __name__ == "__main__":
    main()
