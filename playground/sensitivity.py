"""The reference's own sensitivity to the last bit (docs/architecture.md, Contract 5).

The fixed gradient tolerance (tolerance.py: ULPS units of roundoff of the tensor's largest
value) assumes a backward that does not amplify rounding much. Some do: attention's softmax
backward, P ⊙ (dP − rowsum(dP ⊙ P)), cancels where the attention is sharp, so after a few
steps at a high learning rate the last-bit differences a correct layout makes in its
intermediate values (another summation order) come out of an attention weight's gradient as
over a thousand units of roundoff of its largest element; Higham (2002, §1.6, §4.2) bounds
the rounding of such a sum by the magnitudes of its terms, not of its result, which the
check does not see. The check then measures the amplification instead: where a gradient,
weight or moment comes within `TRIGGER` of its tolerance, the reference runs every step
again from the layout's state with each weight moved by a random unit of roundoff (of the
layout's dtype, relative), and a gradient's tolerance at a step becomes `SENSITIVITY` times
how far that moved it, when that is more than the fixed tolerance, and at most `CAP` times
the fixed one. A step whose routing the moved weights change (a token to another expert,
another count dropped) keeps the fixed tolerance: its spread is not rounding's.

In bfloat16 and float16 the layout is judged against float64 at a fixed share of each
gradient, which a deep model's backward can amplify 16-bit rounding past (an 18-layer model at
lr 0.01: a key weight's gradient 87% off float64's on one device alone in bf16; in fp16 the
same model FAILed at 2.6 times its share, with no layout). There the measure is one device in
the run's own 16-bit recipe from the layout's state (equivalence.reference_steps with
`low_precision`: its micro-batches one by one, the gradients accumulated in the dtype the
layout accumulates them in, fp16's backward at the loss scale the layout's scaler ran the step
at): how far the dtype moves the gradient with no layout at all, against which the layout's is
judged the same way.

A correct layout measured so (benchmarks/check_sweep.py, a dp 4 × ep 2 MoE model at lr 0.01,
step 6): the layout's difference 1,589 units of roundoff, the moved reference's 1,621; over 20
steps of it and of its ZeRO variants the layout's came to at most 2.3 times the moved
reference's, whence `SENSITIVITY`. A
sharding or reduction bug moves a gradient by a whole share of it, 10^9 and more units of
roundoff in float64; `CAP` keeps every planted bug of the suite far over its tolerance.
"""
from __future__ import annotations

import math

import torch

SENSITIVITY = 8  # the margin allowed over the moved reference's spread
CAP = 64  # the most a gradient's tolerance is raised, in units of the fixed tolerance
TRIGGER = 0.25  # the share of a tolerance that sends the check to measure the sensitivity


def moved(states: list, unit: float, seed: int = 0) -> list:
    """`states` (the layout's, per step) with every weight w made w·(1 + unit·r), r standard
    normal, drawn from `seed`: the moments and the biases as they were."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for state in states:
        if "param" in state:
            state = {**state, "param": {n: w * (1 + unit * torch.randn(w.shape, generator=g, dtype=w.dtype))
                                        for n, w in state["param"].items()}}
        out.append(state)
    return out


def _routed_alike(a, b) -> bool:
    """Whether two reference passes of a step routed alike: the same dropped counts, and no
    decision beyond a tie in either."""
    return all(x.dropped == y.dropped and not x.mismatches and not y.mismatches for x, y in zip(a, b))


def raised(ref: list, again: list, fixed: float) -> dict:
    """{(step, name): the gradient's tolerance (relative to its largest reference value)}
    where `again` (the reference from moved weights) says it is more than `fixed`."""
    out = {}
    for step, (r, s) in enumerate(zip(ref, again)):
        if not _routed_alike(r["moe"], s["moe"]):
            continue
        for name, want in r["grads"].items():
            scale = want.abs().max().item() if want.numel() else 0.0
            if scale == 0:
                continue
            spread = (s["grads"][name] - want).abs().max().item() / scale
            if not math.isfinite(spread):  # (a 16-bit reference that overflowed measures nothing)
                continue
            tol = min(SENSITIVITY * spread, CAP * fixed)
            if tol > fixed:
                out[(step, name)] = tol
    return out
