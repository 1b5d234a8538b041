"""What a compiled region holds after its forward on a GPU, against what a plan counts for it.

A GPU runs the MoE layer's regions through torch.compile (model/compiled.py), whose
backward is compiled too: AOTAutograd's min-cut partitioner (Ansel et al. 2024, "PyTorch
2") decides which tensors the forward keeps for backward, and Inductor recomputes the rest
inside its backward kernels. A plan runs each region on the meta device as the partition's
two graphs (`model.compiled.partitioned`), and before that ran it as an eager autograd
graph, which keeps every op's saved inputs. Per region, at the shapes of a 1b-moe step
(micro-batch 4 of 2048 tokens; and 1b-dsmoe's whole layer), the bytes its forward leaves
allocated (its outputs and what it keeps for backward, the inputs it was given not counted):

- `eager` / `compiled`: on the GPU, `torch.cuda.memory_allocated` after the forward less
  before, the function run eagerly and through torch.compile (after a warm-up call);
- `plan (eager graph)` / `plan (partition)`: on the meta device, the distinct new storages
  of the outputs and saved tensors of the eager autograd graph and of the partition's
  forward graph.

    python benchmarks/region_memory_gpu.py [--json F]

On a machine without a GPU (or without torch._grouped_mm's kernels) only the plan's
columns are filled.
"""
import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from benchmarks._common import print_table, write_json  # noqa: E402
from model import preset  # noqa: E402
from model.compiled import _signature, _traced, compiled  # noqa: E402
from model.moe import (balance_losses, capacity, from_slots, grouped_mm_applies, local_experts,  # noqa: E402
                       static_route, to_slots, whole_layer)

MiB = 2 ** 20


def inputs(c, device: str) -> dict:
    """A token group's tensors at micro-batch 4: x, the router, its bias, the experts' bf16
    weights (each needing a gradient, as a step's compute copies do) and logits."""
    torch.manual_seed(0)
    T, d, E = 4 * c.seq_len, c.d_model, c.n_experts
    f = c.expert_d_ff or c.d_ff
    bf = torch.bfloat16

    def leaf(*shape, scale=0.02):
        return (torch.randn(*shape, device=device) * scale).to(bf).requires_grad_()
    x, router = leaf(T, d, scale=1.0), leaf(E, d)
    return {"x": x, "router": router, "bias": torch.zeros(E, device=device), "w_gate": leaf(E, f, d),
            "w_up": leaf(E, f, d), "w_down": leaf(E, d, f), "logits": (x.detach() @ router.detach().t()).requires_grad_()}


def regions(c, t: dict) -> list:
    """[(name, fn, args)]: the whole layer (one GPU) and the regions of a layer that exchanges
    tokens with other ranks (routing, balancing losses, local experts; at a capacity, the
    slots' pad and unpad)."""
    E, k = c.n_experts, c.top_k
    with torch.no_grad():
        scores, tokens, gates, counts, routed, dropped, chosen, assignments = static_route(t["logits"], t["bias"], c)
    out = [("moe_layer", whole_layer, (t["x"], t["router"], t["bias"], t["w_gate"], t["w_up"], t["w_down"], c, 4, 1.0)),
           ("moe_routing", static_route, (t["logits"], t["bias"], c)),
           ("moe_balance_losses", balance_losses, (t["logits"], scores.detach().requires_grad_(), routed, c)),
           ("moe_local_experts", local_experts, (t["x"], tokens, gates.detach().requires_grad_(), counts, t["w_gate"],
                                                 t["w_up"], t["w_down"], k, assignments))]
    if c.capacity_factor:
        C = capacity(c, t["x"].shape[0])
        with torch.no_grad():
            x_slots, slot = to_slots(t["x"], tokens, chosen, assignments, routed, dropped, E, k, C)
        out += [("moe_pad", to_slots, (t["x"], tokens, chosen, assignments, routed, dropped, E, k, C)),
                ("moe_unpad", from_slots, (x_slots.detach().requires_grad_(), slot, gates.detach().requires_grad_(),
                                           tokens, assignments, k))]
    return out


def _tensors(x) -> list:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def new_bytes(tensors, args) -> int:
    """Bytes of the distinct storages among `tensors` that none of `args` has."""
    given = {t.untyped_storage()._cdata for t in _tensors(args)}
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        if s._cdata not in given:
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def on_meta(a):
    if isinstance(a, torch.Tensor):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta").requires_grad_(a.requires_grad)
    return a


def plan_eager(fn, args) -> int:
    """An eager autograd graph's outputs and saved tensors (what a plan counted before)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return new_bytes(_tensors(out) + saved, args)


def plan_partition(name, fn, args) -> int:
    """The partition's forward graph's outputs and saved tensors (what a plan counts now)."""
    graphs = _traced(fn, name, tuple(_signature(a) for a in args))
    return new_bytes(_tensors(graphs.forward(*[a for a in args if isinstance(a, torch.Tensor)])), args)


def held_on_gpu(f, args) -> int:
    """torch.cuda.memory_allocated after f(*args) less before (its outputs kept)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = f(*args)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    del out
    return held


def measured_regions(gpu: bool):
    """(model, region, its function, its inputs, the same on meta, whether the GPU measures it)
    for 1b-moe's regions and 1b-dsmoe's whole layer: a GPU measures a region only where the
    grouped GEMM it is written for applies."""
    for model in ("1b-moe", "1b-dsmoe"):
        c = preset(model)
        t = inputs(c, "cuda" if gpu else "cpu")
        measure_gpu = gpu and grouped_mm_applies(t["x"], t["w_gate"])
        for name, fn, args in regions(c, t):
            if model == "1b-dsmoe" and name != "moe_layer":
                continue
            yield model, name, fn, args, tuple(on_meta(x) for x in args), measure_gpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    gpu = torch.cuda.is_available()
    rows, out = [], {"device": torch.cuda.get_device_name() if gpu else "none (plan columns only)",
                     "torch": torch.__version__, "regions": []}
    for model, name, fn, args, meta_args, measure_gpu in measured_regions(gpu):
        r = {"model": model, "region": name, "plan_eager": plan_eager(fn, meta_args),
             "plan_partition": plan_partition(name, fn, meta_args)}
        if measure_gpu:
            r["eager"] = held_on_gpu(fn, args)
            held_on_gpu(compiled(fn), args)  # (compiled, and its backward made at the first call)
            r["compiled"] = held_on_gpu(compiled(fn), args)
        out["regions"].append(r)
        err = (f"{(r['plan_partition'] - r['compiled']) / r['compiled']:+.1%}" if r.get("compiled") else "-")
        rows.append([model, name, *(f"{r[k] / MiB:.1f}" if k in r else "-" for k in
                                    ("eager", "compiled", "plan_eager", "plan_partition")), err])
    print_table(f"MiB a region's forward leaves allocated, outputs and saved tensors (device: {out['device']}, "
                f"torch {torch.__version__})", ["model", "region", "eager (GPU)", "compiled (GPU)", "plan (eager graph)", "plan (partition)",
                 "partition vs compiled"], rows)
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
