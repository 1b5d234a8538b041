"""Benchmark: activation memory per transformer layer and step time under activation
checkpointing (none / selective / selective-op / full), measured by `playground plan` on meta tensors
(bf16 compute, the saved tensors as autograd and the checkpoint hold them), beside

- this block counted term by term as Korthikanti et al. 2022 count theirs (section 4.1),
  in bytes per s·b·h (s sequence, b micro-batch, h d_model, t tensor-parallel degree,
  k = kv_dim/h, f = d_ff/h, a heads; bf16 activations, e = 2 bytes):
    RMSNorm (each of 2, one fused kernel): its input (e), its fp32 1/rms per token (4/h)
    and its output, which the next matmuls keep (e); attention: q after RoPE (e: RoPE's
    products keep only the tables), k after RoPE and v, each repeated to every query head
    before the kernel (grouped-query attention's k/v heads are expanded: e each, whatever
    k), the kernel's output (e), which is also wo's input (RoPE runs in (s, b, heads)
    order, so merging the heads back is a view, not a copy); the flash kernel
    keeps a log-sum-exp (4a/h) instead of the s² scores; SwiGLU: the gate and up projections, the SiLU output and the product (4fe);
    with tensor parallelism the norms stay whole; with sequence parallelism a norm's own
    tensors take 1/t and its output is kept all-gathered (whole, e);
    selective keeps the block input, q, k, v, the attention output and log-sum-exp, the
    gate and up outputs (all /t) and the outputs of wo and w_down (whole: partial sums
    before their reduction); selective-op (torchtitan's policy: every second matmul of
    the block recomputed, of wq, wk, wv, wo, w_gate, w_up, w_down in that order) keeps the
    same but the outputs of wk, wo and w_up; full keeps the block input only (e, or e/t
    with sequence parallelism);
- Korthikanti et al.'s own formulas for their GPT layer (fp16, LayerNorm, GeLU MLP of
  4h, dropout, attention scores kept): none sbh(34 + 5as/h) without sequence
  parallelism's split of the norms (10 + 24/t + 5as/(ht)), with it (34 + 5as/h)/t; their
  selective recomputation removes the 5as/h term; full recomputation 2 (2/t with SP).

Per layer = the plan's peak activations with 2 layers minus with 1 (the embedding, head
and loss cancel). The recomputation's time shows in the planned step. Writes JSON.
"""
import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
from model import GPTConfig  # noqa: E402
from playground import Layout, RunConfig  # noqa: E402
from playground.planning import plan  # noqa: E402

E = 2  # bytes per bf16 activation element


def this_block(mode: str, c: GPTConfig, t: int, sp: bool) -> float:
    """Bytes per s·b·h a block of the reference GPT keeps (the terms in the docstring)."""
    h = c.d_model
    k, f, lse = c.kv_dim / h, c.d_ff / h, 4 * c.n_heads / h / t
    rsqrt = 2 * 4 / h / (t if sp else 1)  # each norm's fp32 1/rms per token
    if mode == "full":
        return E / (t if sp else 1)
    if mode == "selective":
        kept = E * (1 / (t if sp else 1) + (1 + 2 * k + 1 + 2 * f) / t + 2)
        return kept + lse
    if mode == "selective-op":  # not wk's, wo's and w_up's outputs
        kept = E * (1 / (t if sp else 1) + (1 + k + 1 + f) / t + 1)
        return kept + lse
    if sp:  # each norm: its input (the slice), the gathered output (whole)
        norms = 2 * (E / t + E) + rsqrt
    else:  # each norm: its input, the output the next matmuls keep
        norms = 2 * 2 * E + rsqrt
    return norms + E * (4 + 4 * f) / t + lse


def korthikanti(mode: str, c: GPTConfig, t: int, sp: bool) -> float:
    """Korthikanti et al. 2022, Table 2: bytes per s·b·h of their GPT layer (None for
    selective-op, which they do not count)."""
    if mode == "selective-op":
        return None
    scores = 5 * c.n_heads * c.seq_len / c.d_model / t
    if mode == "full":
        return 2 / (t if sp else 1)
    base = 34 / t if sp else 10 + 24 / t
    return base + (scores if mode == "none" else 0)


def per_layer(mode: str, c: GPTConfig, t: int, sp: bool, mbs: int, hardware: str) -> dict:
    out = {}
    for n in (1, 2):
        cfg = GPTConfig(**{**c.__dict__, "n_layers": n})
        layout = Layout(tp=t, sequence_parallel=sp, micro_batch_size=mbs, ac=mode)
        p = plan(RunConfig(model=cfg, layout=layout, dtype="bfloat16", hardware=hardware, progress=False))
        out[n] = (max(v["memory"]["peak_activations"] for v in p.values), p.step_s)
    sbh = c.seq_len * mbs * c.d_model
    return {"bytes_per_layer": out[2][0] - out[1][0], "per_sbh": (out[2][0] - out[1][0]) / sbh,
            "layer_step_s": out[2][1] - out[1][1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--json", default=default_json("activation_checkpointing"))
    a = ap.parse_args()
    c = GPTConfig(vocab_size=a.vocab, d_model=a.d_model, n_layers=1, n_heads=a.heads, n_kv_heads=a.kv_heads,
                  d_ff=a.d_ff, seq_len=a.seq_len)
    rows = []
    for t, sp in ((1, False), (2, False), (2, True)):
        base = None
        for mode in ("none", "selective", "selective-op", "full"):
            m = per_layer(mode, c, t, sp, a.micro_batch_size, a.hardware)
            base = base or m
            rows.append({"tp": t, "sp": sp, "ac": mode, **m, "this_block_per_sbh": this_block(mode, c, t, sp),
                         "korthikanti_per_sbh": korthikanti(mode, c, t, sp),
                         "of_none": m["bytes_per_layer"] / base["bytes_per_layer"],
                         "time_of_none": m["layer_step_s"] / base["layer_step_s"]})
    title = (f"activations per layer (d_model {a.d_model}, {a.heads} heads, {a.kv_heads} kv heads, d_ff {a.d_ff}, "
             f"seq {a.seq_len}, micro-batch {a.micro_batch_size}, bf16), planned on {a.hardware}")
    print_table(title, ["layout", "ac", "measured MiB", "measured /sbh", "this block /sbh", "Korthikanti /sbh",
                        "of none", "layer step", "of none"],
                [[f"tp{r['tp']}" + ("+sp" if r["sp"] else ""), r["ac"], f"{r['bytes_per_layer'] / 2**20:.1f}",
                  f"{r['per_sbh']:.2f}", f"{r['this_block_per_sbh']:.2f}", f"{r['korthikanti_per_sbh']:.2f}" if r["korthikanti_per_sbh"] is not None else "-",
                  f"{r['of_none']:.2f}", f"{r['layer_step_s'] * 1e3:.2f} ms", f"{r['time_of_none']:.2f}"]
                 for r in rows])
    write_json(a.json, {"benchmark": "activation_checkpointing", "config": vars(a), "rows": rows})


if __name__ == "__main__":
    main()
