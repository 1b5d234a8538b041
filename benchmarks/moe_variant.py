"""`playground` with the MoE layer's GPU path changed, for experiments on one GPU under
torchrun (what a CPU cannot show: CUDA's kernels, the compiled region):

    torchrun --nproc_per_node 1 benchmarks/moe_variant.py three-regions -- check --model tiny-moe ...
    torchrun --nproc_per_node 1 benchmarks/moe_variant.py torch-topk -- train --model 1b-moe ...

Variants, any of them before `--`: `three-regions`, the layer's router, losses and experts as
three compiled regions instead of one (`MoE._whole_on_gpu` false, the path of a layer with
experts on other ranks); `torch-topk`, each token's experts by torch.topk instead of the
stable sort (`model.moe.top_k`), exact ties broken as the device's kernel happens to. An
unknown variant is refused in one line.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list) -> int:
    if "--" not in argv:
        sys.exit("moe_variant: usage: moe_variant.py VARIANT ... -- PLAYGROUND-ARGS")
    split = argv.index("--")
    import model.moe as moe

    variants = {"three-regions": lambda: setattr(moe.MoE, "_whole_on_gpu", lambda self, flat: False),
                "torch-topk": lambda: setattr(moe, "top_k", lambda probs, k: probs.topk(k, dim=-1))}
    for name in argv[:split]:
        if name not in variants:
            sys.exit(f"moe_variant: no variant {name!r} (there are {', '.join(variants)})")
        variants[name]()
        print(f"moe_variant: {name}", flush=True)
    from playground.cli import main as playground

    return playground(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
