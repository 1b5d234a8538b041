"""GPT configuration, named presets, and the parameter-count and FLOPs formulas."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace


def divisors(n: int) -> list:
    """The divisors of n, ascending (what a layout's error offers instead of a size that does not divide)."""
    return [d for d in range(1, n + 1) if n % d == 0]


ROUTERS = ("softmax", "topk_softmax", "sigmoid")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # key/value heads (grouped-query attention, Ainslie et al. 2023); 0: n_heads
    d_ff: int = 0  # SwiGLU hidden width; 0: 8/3·d_model rounded up to a multiple of 16
    seq_len: int = 128
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # mixture of experts (model/moe.py): 0 experts is the dense model
    n_experts: int = 0
    moe_every: int = 1  # every k-th block is an MoE block (blocks k-1, 2k-1, ...)
    top_k: int = 2
    capacity_factor: float = 1.0  # expert slots per token group: ceil(cf·k·T/E); 0: dropless
    # the chosen k gates renormalised to sum to one (GShard's top-2, Mixtral); None: when
    # top_k > 1, since with k = 1 the one gate would be exactly 1 and the router would learn
    # from the auxiliary losses only (Switch Transformer gates its one expert by the raw probability)
    renormalize_gates: bool | None = None
    aux_loss_coef: float = 0.01  # Switch's load-balancing loss α
    z_loss_coef: float = 0.001  # ST-MoE's router z-loss
    # the load-balancing loss's counts: "batch" (Switch: f_i over every token of the microbatch)
    # or "sequence" (DeepSeek-V3's sequence-wise balance loss: f_i and P_i per sequence)
    aux_loss: str = "batch"
    # the router's scores and gates (model/moe.py): "softmax" (softmax, then the top k),
    # "topk_softmax" (Mixtral: the top k logits, then a softmax over them) or "sigmoid"
    # (DeepSeek-V3: sigmoid scores, the top k's gates normalised when renormalize_gates)
    router: str = "softmax"
    # auxiliary-loss-free load balancing (Wang et al. 2024; DeepSeek-V3): a per-expert bias added
    # to the scores for the top-k choice only, moved by this much per step towards the mean load;
    # 0: no bias
    bias_update_rate: float = 0.0
    # fine-grained and shared experts (DeepSeekMoE, Dai et al. 2024): each routed expert's SwiGLU
    # width (0: d_ff), and always-on shared experts beside the routed ones (one SwiGLU of
    # n_shared_experts · expert_d_ff)
    expert_d_ff: int = 0
    n_shared_experts: int = 0
    # the attention kernel (model/gpt.py): "flash" (SDPA's fused kernel: the s×s scores stay on
    # chip), "flash1" (the same arithmetic, priced as FlashAttention-1's kernels of Dao et al.
    # 2022, which runs of 2022-2023 had: half FlashAttention-2's speed, simulator/compute_model.py)
    # or "unfused" (Megatron-LM's of Narayanan et al. 2021: the scores written to memory by a
    # batched matmul, one fused scale-mask-softmax kernel, the probabilities kept)
    attention: str = "flash"
    # dropout on the attention probabilities (model/dropout.py; Megatron-LM's --attention-dropout,
    # 0.1 by default there): unfused attention only, the flash kernel keeps no probabilities
    attention_dropout: float = 0.0

    def __post_init__(self):
        for name, least in (("vocab_size", 2), ("d_model", 1), ("n_layers", 1), ("n_heads", 1), ("seq_len", 2),
                            ("n_kv_heads", 0), ("d_ff", 0), ("n_experts", 0), ("expert_d_ff", 0),
                            ("n_shared_experts", 0)):
            value = getattr(self, name)
            if value < least:
                raise ValueError(f"{name}={value!r} must be a whole number of at least {least}")
        for name in ("capacity_factor", "aux_loss_coef", "z_loss_coef", "rope_base", "norm_eps", "init_std",
                     "bias_update_rate"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)} must be finite")
        if self.norm_eps < 0:  # (RMSNorm would take the root of a negative mean square: a NaN loss)
            raise ValueError(f"norm_eps={self.norm_eps} must be >= 0")
        if self.init_std < 0:
            raise ValueError(f"init_std={self.init_std} must be >= 0")
        if self.rope_base <= 0:  # (the rotary frequencies are its powers)
            raise ValueError(f"rope_base={self.rope_base} must be > 0")
        if self.aux_loss_coef < 0 or self.z_loss_coef < 0:
            raise ValueError(f"aux_loss_coef={self.aux_loss_coef} and z_loss_coef={self.z_loss_coef} must be >= 0")
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", -(-8 * self.d_model // 3 // 16) * 16)
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads} (each key/value "
                             f"head serves a group of query heads)")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if self.router not in ROUTERS:
            raise ValueError(f"router={self.router!r}: choose one of {', '.join(ROUTERS)}")
        if self.router == "topk_softmax" and self.renormalize_gates is False:
            raise ValueError("router='topk_softmax' normalises the k gates by its softmax: renormalize_gates=False "
                             "contradicts it (use router='softmax' for raw probabilities)")
        if self.aux_loss not in ("batch", "sequence"):
            raise ValueError(f"aux_loss={self.aux_loss!r}: choose 'batch' or 'sequence'")
        if self.bias_update_rate < 0:
            raise ValueError(f"bias_update_rate={self.bias_update_rate} must be >= 0")
        if self.moe_every < 1 or self.capacity_factor < 0:
            raise ValueError(f"moe_every={self.moe_every} must be >= 1 and capacity_factor={self.capacity_factor} >= 0")
        if self.attention not in ("flash", "flash1", "unfused"):
            raise ValueError(f"attention={self.attention!r}: choose 'flash', 'flash1' or 'unfused'")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"attention_dropout={self.attention_dropout} must be in [0, 1)")
        if self.attention_dropout and self.attention != "unfused":
            raise ValueError(f"attention_dropout={self.attention_dropout} needs attention='unfused' (it drops the "
                             f"probabilities the unfused attention writes; attention={self.attention!r} keeps none)")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head dim {self.d_model // self.n_heads} must be even for rotary embeddings")

    @property
    def renormalizes(self) -> bool:
        """Whether the top-k gates are renormalised (renormalize_gates, or top_k > 1 when None)."""
        return self.top_k > 1 if self.renormalize_gates is None else self.renormalize_gates

    @property
    def expert_width(self) -> int:
        """A routed expert's SwiGLU width (expert_d_ff, or d_ff when that is 0)."""
        return self.expert_d_ff or self.d_ff

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_kv_heads, or n_heads when that is 0)."""
        return self.n_kv_heads or self.n_heads

    @property
    def kv_dim(self) -> int:
        """The width of the key and value projections."""
        return self.kv_heads * self.head_dim

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` has experts instead of the dense SwiGLU MLP."""
        return self.n_experts > 0 and layer % self.moe_every == self.moe_every - 1

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layers))

    def with_(self, **kw) -> "GPTConfig":
        return replace(self, **kw)

    def to_dict(self) -> dict:
        return asdict(self)

    # -- formulas ------------------------------------------------------------------------
    def n_params(self) -> int:
        """Every parameter: embedding, per block two RMSNorm weights, q/k/v/o and the three
        SwiGLU matrices, the final norm, the untied LM head."""
        d, f, V, L, E = self.d_model, self.d_ff, self.vocab_size, self.n_layers, self.n_experts
        moe, g = self.n_moe_layers, self.expert_width
        # an MoE block: router, E experts and the shared ones
        mlp = (L - moe) * 3 * d * f + moe * (E * d + (E + self.n_shared_experts) * 3 * d * g)
        attn = 2 * d * d + 2 * d * self.kv_dim  # q and o; k and v (narrower with grouped-query attention)
        return V * d + L * (2 * d + attn) + mlp + d + d * V

    def flops_per_token(self, training: bool = True) -> int:
        """Matmul FLOPs per token (PaLM appendix B): 2 per multiply-add of every weight
        matrix the token meets (blocks and LM head; the embedding is a lookup), plus
        attention's QK^T and AV at 2·2·s·d per layer (full s×s, as kernels compute it
        without exploiting the causal mask). Training is 3× forward (backward = 2×)."""
        d, f, V, L, s = self.d_model, self.d_ff, self.vocab_size, self.n_layers, self.seq_len
        moe = self.n_moe_layers  # a token meets the router, its top_k experts and the shared ones
        mlp = (L - moe) * 3 * d * f + moe * (self.n_experts * d
                                             + (self.top_k + self.n_shared_experts) * 3 * d * self.expert_width)
        forward = 2 * (L * (2 * d * d + 2 * d * self.kv_dim) + mlp + d * V) + L * 4 * s * d
        return 3 * forward if training else forward

    def mfu(self, tokens_per_s: float, devices: int, peak_flops: float) -> float:
        """Model FLOPs utilisation (Chowdhery et al. 2022, PaLM, appendix B): the training
        FLOPs of `tokens_per_s` over `devices` devices of `peak_flops` each."""
        return self.flops_per_token() * tokens_per_s / (devices * peak_flops)


PRESETS = {
    # for tests: well under a second a step on a laptop CPU
    "tiny": GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=32),
    # the demo: the benchmark's shape
    "small": GPTConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, seq_len=128),
    # for GPUs (GPT-2/3 widths with a 50304 vocabulary, a multiple of 64)
    "125m": GPTConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, seq_len=1024),
    "350m": GPTConfig(vocab_size=50304, d_model=1024, n_layers=24, n_heads=16, seq_len=1024),
    "1b": GPTConfig(vocab_size=50304, d_model=2048, n_layers=16, n_heads=32, seq_len=2048),
    # Llama-style shapes, for planning (grouped-query attention in 70b; Touvron et al. 2023, Llama 2;
    # the Llama 3 herd's 128256-token vocabulary for 70b)
    "7b": GPTConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008, seq_len=4096),
    "13b": GPTConfig(vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, d_ff=13824, seq_len=4096),
    "70b": GPTConfig(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
                     seq_len=4096),
    # mixture of experts: every block has experts (top-2 of E)
    "tiny-moe": GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=32, n_experts=4, top_k=2),
    "small-moe": GPTConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, seq_len=128, n_experts=8, top_k=2),
    # about 1B parameters in all, 8 experts, top-2 (about 0.33B active per token)
    "1b-moe": GPTConfig(vocab_size=50304, d_model=1024, n_layers=12, n_heads=16, seq_len=2048, n_experts=8,
                        top_k=2),
    # today's MoE (DeepSeekMoE's fine-grained and shared experts; DeepSeek-V3's sigmoid router,
    # auxiliary-loss-free bias, dropless, and a small sequence-wise balance loss): 1b-moe's
    # experts each cut in two (16 of half the width, top-4) beside one shared expert
    "tiny-dsmoe": GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=32, n_experts=8, top_k=2,
                            expert_d_ff=48, n_shared_experts=1, router="sigmoid", bias_update_rate=0.001,
                            capacity_factor=0.0, aux_loss="sequence", aux_loss_coef=0.0001),
    "1b-dsmoe": GPTConfig(vocab_size=50304, d_model=1024, n_layers=12, n_heads=16, seq_len=2048, n_experts=16,
                          top_k=4, expert_d_ff=1368, n_shared_experts=1, router="sigmoid", bias_update_rate=0.001,
                          capacity_factor=0.0, aux_loss="sequence", aux_loss_coef=0.0001),
}


# AdamW peak learning rate per preset: GPT-3's values for its 125M, 350M and 1.3B models
# (Brown et al. 2020, table 2.1); the tiny CPU models learn fastest at 3e-3.
DEFAULT_LR = {"tiny": 3e-3, "small": 3e-3, "125m": 6e-4, "350m": 3e-4, "1b": 2e-4,
              "tiny-moe": 3e-3, "small-moe": 3e-3, "1b-moe": 3e-4, "tiny-dsmoe": 3e-3, "1b-dsmoe": 3e-4, "7b": 3e-4, "13b": 3e-4, "70b": 1.5e-4}


def preset(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].with_(**overrides) if overrides else PRESETS[name]
