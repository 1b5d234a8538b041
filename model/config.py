"""GPT configuration, named presets, and the parameter-count and FLOPs formulas."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 0  # SwiGLU hidden width; 0: 8/3·d_model rounded up to a multiple of 16
    seq_len: int = 128
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", -(-8 * self.d_model // 3 // 16) * 16)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head dim {self.d_model // self.n_heads} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def with_(self, **kw) -> "GPTConfig":
        return replace(self, **kw)

    def to_dict(self) -> dict:
        return asdict(self)

    # -- formulas ------------------------------------------------------------------------
    def n_params(self) -> int:
        """Every parameter: embedding, per block two RMSNorm weights, q/k/v/o and the three
        SwiGLU matrices, the final norm, the untied LM head."""
        d, f, V, L = self.d_model, self.d_ff, self.vocab_size, self.n_layers
        return V * d + L * (2 * d + 4 * d * d + 3 * d * f) + d + d * V

    def flops_per_token(self, training: bool = True) -> int:
        """Matmul FLOPs per token (PaLM appendix B): 2 per multiply-add of every weight
        matrix the token meets (blocks and LM head; the embedding is a lookup), plus
        attention's QK^T and AV at 2·2·s·d per layer (full s×s, as kernels compute it
        without exploiting the causal mask). Training is 3× forward (backward = 2×)."""
        d, f, V, L, s = self.d_model, self.d_ff, self.vocab_size, self.n_layers, self.seq_len
        forward = 2 * (L * (4 * d * d + 3 * d * f) + d * V) + L * 4 * s * d
        return 3 * forward if training else forward


PRESETS = {
    # for tests: well under a second a step on a laptop CPU
    "tiny": GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=32),
    # the demo: the benchmark's shape
    "small": GPTConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, seq_len=128),
    # for GPUs (GPT-2/3 widths with a 50304 vocabulary, a multiple of 64)
    "125m": GPTConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, seq_len=1024),
    "350m": GPTConfig(vocab_size=50304, d_model=1024, n_layers=24, n_heads=16, seq_len=1024),
    "1b": GPTConfig(vocab_size=50304, d_model=2048, n_layers=16, n_heads=32, seq_len=2048),
}


# AdamW peak learning rate per preset: GPT-3's values for its 125M, 350M and 1.3B models
# (Brown et al. 2020, table 2.1); the tiny CPU models learn fastest at 3e-3.
DEFAULT_LR = {"tiny": 3e-3, "small": 3e-3, "125m": 6e-4, "350m": 3e-4, "1b": 2e-4}


def preset(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].with_(**overrides) if overrides else PRESETS[name]
