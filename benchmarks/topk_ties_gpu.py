"""Whether a routing decision depends on the device: torch.topk against the stable-sort top-k
(`model.moe.top_k`) on the router scores of bf16 logits, on CUDA (eager and compiled) and on
the CPU, and how many tokens' experts the two devices give otherwise.

bf16 keeps 8 bits of mantissa, so the logits of a token tie often; softmax or sigmoid scores
of equal logits are equal, and the choice among them is then the kernel's. The check replays
a GPU layout's decisions on the CPU (`model.moe.MoE._replayed`) and needs one answer.

    python benchmarks/topk_ties_gpu.py [--tokens 16384] [--experts 8 16 64] [--json F]
"""
from __future__ import annotations

import argparse
import json

import torch

from model.moe import top_k


def _rows_differing(a, b) -> int:
    return int((a.cpu() != b.cpu()).any(dim=-1).sum())


def compare(tokens: int, experts: int, k: int, seed: int) -> dict:
    """Per (experts, k): tokens with an exact tie among their k+1 highest scores, and tokens
    whose experts differ between CUDA and the CPU under each top-k."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, experts, generator=g) * 2).to(torch.bfloat16)
    scores = torch.softmax(logits.float(), dim=-1)
    on_gpu = scores.cuda()
    top = scores.sort(dim=-1, descending=True).values[:, :k + 1]
    tied = int((top[:, 1:] == top[:, :-1]).any(dim=-1).sum())
    compiled = torch.compile(top_k, dynamic=False)
    return {"experts": experts, "k": k, "tokens": tokens, "tokens_with_a_tie": tied,
            "topk_cuda_vs_cpu": _rows_differing(on_gpu.topk(k, dim=-1).indices, scores.topk(k, dim=-1).indices),
            "stable_cuda_vs_cpu": _rows_differing(top_k(on_gpu, k)[1], top_k(scores, k)[1]),
            "stable_compiled_cuda_vs_cpu": _rows_differing(compiled(on_gpu, k)[1], top_k(scores, k)[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--experts", type=int, nargs="+", default=[4, 8, 16, 64])
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = [compare(a.tokens, e, k, seed=e) for e in a.experts for k in (2, 4) if k < e]
    print("| experts | k | tokens with a tie | torch.topk: CUDA ≠ CPU | stable sort: CUDA ≠ CPU | compiled |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['experts']} | {r['k']} | {r['tokens_with_a_tie']} | {r['topk_cuda_vs_cpu']} | "
              f"{r['stable_cuda_vs_cpu']} | {r['stable_compiled_cuda_vs_cpu']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
