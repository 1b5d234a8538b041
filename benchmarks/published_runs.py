"""The published training runs `playground plan` is held to (benchmarks/published.py).

Each run as its source states it: the model, the layout, the batch, the precision, the
recomputation, the GPUs, and the throughput it reports, converted to tokens per second
per GPU with the source's own FLOP count where it reports FLOP/s. What a source does not
state is chosen here and said in `chosen`. Models are this project's GPT (RMSNorm, RoPE,
SwiGLU, untied head); a GeLU MLP of width 4h is planned as SwiGLU of width 8h/3 rounded
down to a multiple of 64, which holds the same 8h² parameters and FLOPs per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from model import GPTConfig
from playground import Layout


@dataclass(frozen=True)
class PublishedRun:
    source: str  # short name of the source
    cite: str  # paper and table (or file and section)
    name: str  # the row as the source names it
    hardware: str  # the project's profile of the source's GPU
    model: GPTConfig
    layout: Layout
    tokens_per_s_per_gpu: float  # published, converted as `published` says
    published: str  # the figure as printed
    chosen: str = ""  # what the source does not state, and what is taken for it
    memory_gb: float | None = None  # published memory per GPU (GB), where given
    memory_what: str = ""  # what that memory counts
    run: dict = field(default_factory=dict)  # RunConfig fields besides the defaults (grad_overlap)
    # the interconnect as the source states it, where its cluster's is not the profile's (a DGX's:
    # NVSwitch, 200-400 Gb/s per GPU): Hardware fields, the GPU's own numbers left as profiled
    links: dict = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return self.layout.world


def gelu_gpt(vocab: int, h: int, heads: int, layers: int, seq: int, **kw) -> GPTConfig:
    """A GPT-3-style model (GeLU MLP of 4h) as this project's GPT of the same parameters and FLOPs."""
    return GPTConfig(vocab_size=vocab, d_model=h, n_layers=layers, n_heads=heads, d_ff=8 * h // 3 // 64 * 64,
                     seq_len=seq, **kw)


def llama3(size: str, seq: int, layers: int | None = None) -> GPTConfig:
    """Llama 3 shapes (Dubey et al. 2024, Table 3): d_model, layers, heads, d_ff; 8 key/value
    heads, vocabulary 128256."""
    d, L, h, f = {"8b": (4096, 32, 32, 14336), "70b": (8192, 80, 64, 28672), "405b": (16384, 126, 128, 53248)}[size]
    return GPTConfig(vocab_size=128256, d_model=d, n_layers=layers or L, n_heads=h, n_kv_heads=8, d_ff=f, seq_len=seq,
                     rope_base=500000.0)


def megatron_flops_per_token(cfg: GPTConfig, layers: int, recompute: bool) -> float:
    """Narayanan et al. 2021, equation 3, per token: 96·l·h²·(1 + s/(6h) + V/(16·l·h)), the
    recomputation's forward included (72 without it: Megatron-LM's printed TFLOP/s)."""
    h, s, V = cfg.d_model, cfg.seq_len, cfg.vocab_size
    return (96 if recompute else 72) * layers * h * h * (1 + s / (6 * h) + V / (16 * layers * h))


# -- Narayanan et al. 2021, Table 1 (A100 80GB, Selene) --------------------------------------
NARAYANAN_TABLE = [  # billions, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
_MEGATRON_2021 = ("micro-batch 1, 1F1B, no sequence parallelism (it came in 2022), attention without FlashAttention "
                  "(scores in memory, fused softmax; dropout 0.1 on the probabilities, Megatron-LM's default), "
                  "gradients all-reduced after the pipeline's backward (Megatron-LM's local DDP of 2021)")


def narayanan(row) -> PublishedRun:
    billions, heads, h, l, t, p, n, batch, tflops = row
    cfg = gelu_gpt(51200, h, heads, l, 2048, attention="unfused", attention_dropout=0.1)
    dp = n // (t * p)
    return PublishedRun(
        "Narayanan 2021", "Narayanan et al. 2021 (Megatron-LM), Table 1", f"{billions}B", "a100-80gb", cfg,
        Layout(dp=dp, tp=t, pp=p, micro_batch_size=1, microbatches=batch // dp, ac="full"),
        tflops * 1e12 / megatron_flops_per_token(cfg, l, True), f"{tflops} TFLOP/s per GPU (equation 3)",
        _MEGATRON_2021, run={"grad_overlap": False})


# -- Korthikanti et al. 2022, Table 5 (A100 80GB, Selene) -------------------------------------
def korthikanti(size: str, method: str) -> PublishedRun:
    """Iteration times of full recomputation against sequence parallelism with selective
    recomputation (Table 5); shapes and layouts from Table 3 (22B: t 8; 175B: t 8, p 8,
    interleaved with 3 chunks per rank), sequence 2048, vocabulary 51200, micro-batch 1."""
    (h, heads, l, t, p, v, batch), secs = {
        "22B": ((6144, 64, 48, 8, 1, 1, 4), {"full": 1.42, "seq+sel": 1.10}),
        "175B": ((12288, 96, 96, 8, 8, 3, 64), {"full": 18.13, "seq+sel": 13.75}),
    }[size]
    cfg = gelu_gpt(51200, h, heads, l, 2048, attention="unfused", attention_dropout=0.1)
    sel = method == "seq+sel"
    n = t * p
    return PublishedRun(
        "Korthikanti 2022", "Korthikanti et al. 2022, Table 5 (layouts: Table 3)", f"{size} {method}", "a100-80gb", cfg,
        Layout(tp=t, pp=p, micro_batch_size=1, microbatches=batch, sequence_parallel=sel,
               ac="selective" if sel else "full", schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v),
        batch * 2048 / secs[method] / n, f"{secs[method]} s per iteration",
        "data parallelism 1 (GPUs = t·p); attention and reductions as in Narayanan 2021 above",
        run={"grad_overlap": False})


# -- BLOOM (BigScience 2022) ------------------------------------------------------------------
# Jean Zay's A100 nodes as the BLOOM paper states them (Le Scao et al. 2022, section 3.4.1,
# "Hardware"): "4 NVLink GPU-to-GPU interconnects per node", read as 4 NVLink 3 links per GPU
# where a DGX A100's NVSwitch gives each 12, so a third of the profile's NCCL bus bandwidth
# (232.5 GB/s); "4 Omni-Path 100 Gbps links per node" for its 8 GPUs: 50 Gb/s per GPU
JEAN_ZAY = {"nvlink_bandwidth": 232.5e9 / 3, "network_bandwidth": 4 * 100e9 / 8 / 8}
_JEAN_ZAY = ("Jean Zay's interconnect as the paper states it (`JEAN_ZAY`: 4 NVLinks per GPU, a third of a DGX's; "
             "4 × 100 Gb/s Omni-Path per node); the paper's \"4 NVLink GPU-to-GPU interconnects per node\" could "
             "also be read as NVSwitch, which the profile has: planned so, the 176B run was +27.9%")
def bloom() -> PublishedRun:
    """BLOOM-176B: 70 layers, hidden 14336, 112 heads, vocabulary 250880 (padded), sequence
    2048, global batch 2048 (Le Scao et al. 2022, BLOOM, section 3.4 and Table 3); 384 A100
    80GB, TP 4 × PP 12 × DP 8, about 150 TFLOP/s per GPU and 60 GB used per GPU (BigScience
    176B model card, "the engineering side")."""
    cfg = gelu_gpt(250880, 14336, 112, 70, 2048, attention="unfused")
    return PublishedRun(
        "BLOOM 2022", "Le Scao et al. 2022 (BLOOM), section 3.4; BigScience 176B model card", "176B", "a100-80gb", cfg,
        Layout(dp=8, tp=4, pp=12, zero=1, micro_batch_size=2, microbatches=128, ac="full",
               stage_layers=(5,) + (6,) * 10 + (5,)),
        150e12 / megatron_flops_per_token(cfg, 70, True), "150 TFLOP/s per GPU (Megatron's count)",
        "micro-batch 2, ZeRO-1, full recomputation, 1F1B, unfused attention without dropout (Megatron-DeepSpeed of "
        "2022); the 70 layers split as the run's script splits them (bigscience-workshop/bigscience, "
        "train/tr11-176B-ml/tr11-176B-ml.slurm: --pp-partition-method 'type:transformer|embedding', each embedding "
        "counted as a layer): 5 on the first and the last stage, 6 on the others. The script also sets "
        "CUDA_LAUNCH_BLOCKING=1 (\"or the training will hang\"), which makes every launch wait for its kernel: not "
        "modelled (the chronicles-prequel measured it at -6% on 80 GPUs, none on 160). Six of its layers on one node "
        "plan at about the same error as this run (`bloom_one_node`). "
        "Gradients accumulated and reduced in float32 after the pipeline's schedule (`grad_dtype`, `reduce_dtype`): "
        "DeepSpeed's bf16 optimizer, written for this run, accumulates and reduces them in fp32 (microsoft/DeepSpeed "
        "pull request 1801, \"bf16+pipeline parallelism\": \"fp32 reduction\"; its gradient buffers are float32, "
        "the width of the masters). The model card's 60 GB is the memory used on each GPU, the allocator's "
        "cache and the CUDA context included; the plan's is the peak of what is allocated. " + _JEAN_ZAY,
        memory_gb=60.0, memory_what="used per GPU (model card)",
        run={"grad_overlap": False, "reduce_dtype": "float32", "grad_dtype": "float32"},
        links=JEAN_ZAY)


def bloom_one_node() -> PublishedRun:
    """BLOOM's cluster on one node, no pipeline and no network (bigscience-workshop/bigscience,
    train/tr11-176B-ml/chronicles-prequel.md, "Max possible TFLOPs check for NHIDDEN=14336",
    2022-02-21): 6 layers of BLOOM's width, TP 8, micro-batch 2, global batch 2048, measured
    at 143.48 and 157.02 TFLOP/s on the same configuration (the median taken). Not a row of
    the suite (a benchmark, not a training run): it says whether the 176B row's error is the
    pipeline's and the network's or each GPU's."""
    cfg = gelu_gpt(250880, 14336, 64, 6, 2048, attention="unfused")
    tflops = (143.48 + 157.02) / 2
    return PublishedRun(
        "BLOOM 2022", "bigscience-workshop/bigscience, train/tr11-176B-ml/chronicles-prequel.md (2022-02-21)",
        "18B on one node", "a100-80gb", cfg,
        Layout(tp=8, micro_batch_size=2, microbatches=1024, ac="full"),
        tflops * 1e12 / megatron_flops_per_token(cfg, 6, True), "143.48 and 157.02 TFLOP/s (Megatron's count)",
        "64 heads (the prequel's runs after this one say all had 64), vocabulary 250,880 (BLOOM's padded 250k), "
        "full recomputation and unfused attention as the 176B run; " + _JEAN_ZAY, run={"grad_overlap": False},
        links=JEAN_ZAY)


# -- Llama 3 (Dubey et al. 2024), Table 4 (H100 SXM, 400 Gb/s per GPU) -------------------------
def llama3_405b(gpus: int, dp: int, per_dp: int, tflops: float) -> PublishedRun:
    cfg = llama3("405b", 8192)
    return PublishedRun(
        "Llama 3 2024", "Dubey et al. 2024 (The Llama 3 Herd of Models), Table 4 and section 3.3.2", f"405B on {gpus:,}",
        "h100-sxm", cfg,
        Layout(dp=dp, tp=8, pp=16, zero=1, sequence_parallel=True, micro_batch_size=1, microbatches=per_dp,
               schedule="interleaved", virtual_stages=8, stage_layers=(0,) + (1,) * 126 + (0,)),
        tflops * 1e12 / cfg.flops_per_token(), f"{tflops:.0f} TFLOP/s per GPU (BF16 MFU, PaLM's count)",
        "sequence parallelism with TP 8, ZeRO-1 (FSDP without resharding, section 3.3.2), interleaved 1F1B, "
        "micro-batch 1, no recomputation. The pipeline as section 3.3.2 balances it: a layer fewer on the first and "
        "the last stage, so that the first chunk of the first stage holds only the embedding and the last chunk of "
        "the last only the head and the loss; chunks of one layer (8 per rank), which that sentence implies (the "
        "depth is not stated; with chunks of two layers, first and last of one, the plan is 7.3% slower on 8,192). "
        "The plan's peak does not fit the H100's 80 GB: the paper leaves unstated how it saved activations; with "
        "full recomputation, which fits, the plan is 146 tokens/s per GPU on 8,192 (-11.1%)")


# -- MosaicML llm-foundry benchmarks (FSDP, FULL_SHARD) ---------------------------------------
MPT = {"7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48), "70b": (8192, 64, 80)}


def mpt(size: str, gpu: str, gpus: int, mbs: int, accum: int, ac: bool, tps: float, pure: bool = False,
        seq: int = 2048) -> PublishedRun:
    h, heads, l = MPT[size]
    cfg = gelu_gpt(50368, h, heads, l, seq, attention="flash1")
    hw = {"a100": "a100-80gb", "h100": "h100-sxm"}[gpu]
    return PublishedRun(
        "llm-foundry", f"mosaicml/llm-foundry, scripts/train/benchmarking/README.md ({gpu.upper()} 80GB tables); shapes "
        f"from scripts/train/yamls/pretrain/mpt-{size}.yaml",
        f"MPT-{size} on {gpus} {gpu.upper()}" + (f", sequence {seq:,}" if seq != 2048 else ""), hw, cfg,
        Layout(dp=gpus, zero=3, micro_batch_size=mbs, microbatches=accum, ac="full" if ac else "none"),
        tps, f"{tps:,} tokens/s per GPU",
        "FlashAttention-1's kernels (`attention='flash1'`: half the profile's flash rate, simulator/compute_model.py): "
        "the tables ran llm-foundry v0.0.4 (sweep.sh: GIT_COMMIT v0.0.4, a torch 2.0.1, CUDA 11.8 image) installed "
        "with its `gpu` extra (submit_benchmarks.py: pip_install '-e .[gpu]'), which pinned the flash-attn package "
        "at 1.x as late as 2024 (setup.py: flash-attn 1.0.9; FlashAttention-2 was the separate `gpu-flash2` extra), "
        "and attn_impl 'flash' calls FlashAttention-1's flash_attn_unpadded_func where that package is installed "
        "(llmfoundry/models/layers/attention.py); learned positions and tied embeddings not modelled; "
        "nodes of 8 GPUs on the profile's network (A100 rows: 1600 Gb/s RoCE per node, the table's header); "
        + ("gradients reduced in bf16 (the row's PURE mixed precision)" if pure else
           "gradients reduced in float32 (the row's DEFAULT mixed precision: Composer's reduce_dtype float32; an "
           "older Composer all-gathered fp32 parameters instead, which this project does not model)"),
        run={} if pure else {"reduce_dtype": "float32"})


# -- torchtitan, docs/performance.md (FSDP2, 64 A100 80GB) ------------------------------------
def torchtitan(size: str, ac: str, tps: float) -> PublishedRun:
    return PublishedRun(
        "torchtitan", "pytorch/torchtitan docs/performance.md, Llama 3 on 64 A100 (80GB) with FSDP2",
        f"Llama 3 {size.upper()} ({ac} AC)", "a100-80gb", llama3(size, 8192),
        Layout(dp=64, zero=3, micro_batch_size=1, microbatches=1, ac=ac),
        tps, f"{tps:,} WPS (tokens/s per GPU)",
        "sequence 8192 (torchtitan's Llama 3 configs; the table does not say), flash attention, gradients reduced in "
        "float32 (torchtitan's default mixed_precision_reduce); selective op AC planned as this project's "
        "selective-op, torchtitan's policy (matmul and attention outputs kept, but every second matmul's)",
        run={"reduce_dtype": "float32"})


def mpt_by_sequence() -> list:
    """MPT-7b on 8 GPUs of each kind at every sequence length of the same tables (1,024 to
    65,536 tokens; micro-batch, accumulation and recomputation as each row gives them): not
    rows of the suite (one model of one source), but how its error moves with the share of
    the step that attention takes, which grows with the sequence."""
    a100 = [(1024, 64, 2, True, 4357), (2048, 6, 2, False, 4641), (4096, 16, 2, True, 3684), (8192, 8, 2, True, 3206),
            (16384, 4, 2, True, 2453), (32768, 2, 2, True, 1672), (65536, 1, 2, True, 1013)]
    h100 = [(1024, 64, 2, True, 10203), (2048, 6, 1, False, 10643), (4096, 16, 2, True, 8611), (8192, 8, 2, True, 6935),
            (32768, 2, 2, True, 3318), (65536, 1, 2, True, 1956)]
    return [mpt("7b", gpu, 8, mbs, accum, ac, tps, seq=seq)
            for gpu, table in (("a100", a100), ("h100", h100)) for seq, mbs, accum, ac, tps in table]


def suite() -> list:
    """The published runs, in order of source."""
    rows = [narayanan(r) for r in NARAYANAN_TABLE if r[0] < 100]
    rows += [korthikanti(s, m) for s in ("22B", "175B") for m in ("full", "seq+sel")]
    rows += [bloom()]
    rows += [llama3_405b(8192, 64, 32, 430), llama3_405b(16384, 128, 16, 400)]
    rows += [mpt("7b", "a100", 8, 6, 2, False, 4641), mpt("13b", "a100", 8, 2, 3, False, 2262),
             mpt("30b", "a100", 8, 3, 21, True, 916), mpt("70b", "a100", 64, 8, 4, True, 410, pure=True),
             mpt("7b", "h100", 8, 6, 1, False, 10643), mpt("13b", "h100", 64, 2, 1, False, 4800),
             mpt("30b", "h100", 32, 14, 3, True, 2308), mpt("70b", "h100", 64, 8, 4, True, 1039)]
    rows += [torchtitan("8b", "selective-op", 2973), torchtitan("70b", "full", 331)]
    return rows
