"""Data sources, with no download. Each returns, for a training step, the *global* batch
(docs/architecture.md, Contract 5): `global_batch(step, n_sequences, seq_len)` is a (n, seq_len+1)
int64 tensor that depends only on (source, seed, step), so every layout sees the same
tokens; a layout then splits it (DP by rows, the pipeline into microbatches, CP along
the sequence).

- `MarkovSource`: sequences from a seeded random first-order Markov chain over the
  vocabulary, started from its stationary distribution π. Its entropy rate
  H = -Σ_i π_i Σ_j P_ij log P_ij is the loss floor: no model can predict the next token
  better than the chain's own transition probabilities, and a GPT can learn them.
- `TextSource`: a text file read as bytes (vocabulary 256).
- `TokenFileSource`: a `.npy` array of token ids, or a `.bin` of uint16 as nanoGPT writes.
"""
from __future__ import annotations

import os

import numpy as np
import torch


class MarkovSource:
    """A seeded random first-order Markov chain: state i moves to one of `successors`
    states (drawn at random) with Dirichlet(concentration) probabilities. Sparse rows keep
    it small for any vocabulary (50k tokens: 50k × 32 entries, not 50k²)."""

    def __init__(self, vocab_size: int, seed: int = 0, concentration: float = 0.3, successors: int = 32):
        self.vocab_size = vocab_size
        self.seed = seed
        k = min(successors, vocab_size)
        rng = np.random.default_rng([seed, 0x4D41524B])  # 'MARK'
        self.next_states = np.stack([rng.choice(vocab_size, size=k, replace=False) for _ in range(vocab_size)]) \
            if k < vocab_size else np.tile(np.arange(vocab_size), (vocab_size, 1))
        self.probs = rng.dirichlet(np.full(k, concentration), size=vocab_size)
        self._cum = np.cumsum(self.probs, axis=1)
        self._cum[:, -1] = 1.0
        self.stationary = self._stationary()

    def _stationary(self, tol: float = 1e-14, max_iter: int = 100_000) -> np.ndarray:
        """π = πP by lazy power iteration (π ← (π + πP)/2 has the same fixed point and
        converges even for a periodic chain)."""
        V = self.vocab_size
        pi = np.full(V, 1.0 / V)
        flat_next = self.next_states.ravel()
        for _ in range(max_iter):
            step = np.bincount(flat_next, weights=(pi[:, None] * self.probs).ravel(), minlength=V)
            new = 0.5 * (pi + step)
            if np.abs(new - pi).sum() < tol:
                return new / new.sum()
            pi = new
        raise RuntimeError(f"Markov chain (vocab {V}, seed {self.seed}): stationary distribution did not converge")

    def transition_prob(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """P(next = b | current = a), elementwise."""
        match = self.next_states[a] == b[..., None]
        return (self.probs[a] * match).sum(axis=-1)

    @property
    def loss_floor(self) -> float:
        """The entropy rate in nats per token."""
        with np.errstate(divide="ignore", invalid="ignore"):
            plogp = np.where(self.probs > 0, self.probs * np.log(self.probs), 0.0)
        return float(-(self.stationary * plogp.sum(axis=1)).sum())

    def describe(self) -> str:
        return (f"synthetic Markov chain over {self.vocab_size} tokens (seed {self.seed}), "
                f"entropy rate {self.loss_floor:.4f} nats/token = the loss floor")

    def global_batch(self, step: int, n: int, seq_len: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, step])
        out = np.empty((n, seq_len + 1), dtype=np.int64)
        out[:, 0] = np.minimum(np.searchsorted(np.cumsum(self.stationary), rng.random(n)), self.vocab_size - 1)
        u = rng.random((n, seq_len))
        for t in range(seq_len):
            state = out[:, t]
            choice = (self._cum[state] < u[:, t:t + 1]).sum(axis=1)
            out[:, t + 1] = self.next_states[state, choice]
        return torch.from_numpy(out)


class DataError(ValueError):
    """A data file that cannot be trained on; the message names the file and the problem."""


class _WindowSource:
    """Random windows of seq_len+1 tokens from one long token array."""

    loss_floor = None

    def __init__(self, tokens: np.ndarray, vocab_size: int, seed: int, what: str):
        if tokens.ndim != 1:
            raise DataError(f"{what}: expected a 1-D array of token ids, got shape {tokens.shape}")
        self.tokens, self.vocab_size, self.seed, self.what = tokens, vocab_size, seed, what

    def describe(self) -> str:
        return f"{self.what}: {len(self.tokens):,} tokens, vocabulary {self.vocab_size} (no known loss floor)"

    def require(self, seq_len: int) -> "_WindowSource":
        """Refuse a file shorter than one training window."""
        if len(self.tokens) < seq_len + 1:
            raise DataError(f"{self.what} has {len(self.tokens):,} tokens, fewer than one sequence of seq_len+1 = "
                            f"{seq_len + 1}")
        return self

    def global_batch(self, step: int, n: int, seq_len: int) -> torch.Tensor:
        self.require(seq_len)
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - seq_len, size=n)
        idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
        return torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))


class TextSource(_WindowSource):
    def __init__(self, path: str, seed: int = 0):
        data = np.fromfile(path, dtype=np.uint8)
        super().__init__(data, 256, seed, f"text file {path}")


class TokenFileSource(_WindowSource):
    """A `.npy` array of integer token ids, or a `.bin` of uint16 ids (nanoGPT's format)."""

    def __init__(self, path: str, seed: int = 0, vocab_size: int | None = None):
        what = f"token file {path}"
        if path.endswith(".npy"):
            try:
                tokens = np.load(path, mmap_mode="r", allow_pickle=False)
            except ValueError as e:  # a pickled object array, or not a .npy at all
                raise DataError(f"{what}: not a NumPy array of token ids ({e})") from None
            if not np.issubdtype(tokens.dtype, np.integer):
                raise DataError(f"{what}: holds {tokens.dtype} values; token ids must be integers")
        elif path.endswith(".bin"):
            size = os.path.getsize(path)
            if size % 2:
                raise DataError(f"{what}: {size:,} bytes, an odd number: a .bin holds uint16 token ids (2 bytes each)")
            tokens = np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, dtype=np.uint16)
        else:
            raise DataError(f"{what}: expected .npy or .bin (uint16, nanoGPT)")
        if tokens.ndim == 1 and len(tokens):
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0:
                raise DataError(f"{what}: holds the negative token id {low}; ids must be in [0, vocab_size)")
            if vocab_size is not None and high >= vocab_size:
                raise DataError(f"{what}: holds token id {high}, outside the model's vocab_size={vocab_size} "
                                f"(ids must be < {vocab_size}; choose a model whose vocabulary covers the file)")
            top = high + 1
        else:
            top = 0
        super().__init__(tokens, vocab_size or top, seed, what)


def make_source(data: str | None, vocab_size: int, seed: int, seq_len: int | None = None):
    """'markov' (default) or a path: .npy/.bin -> token ids, any other file -> its bytes.
    With `seq_len`, a file shorter than one sequence is refused here, before any work."""
    if data in (None, "markov"):
        return MarkovSource(vocab_size, seed)
    if not os.path.exists(data):
        raise DataError(f"--data {data}: no such file")
    if os.path.isdir(data):
        raise DataError(f"--data {data}: a folder, not a file")
    if os.path.getsize(data) == 0:
        raise DataError(f"--data {data}: the file is empty")
    if data.endswith((".npy", ".bin")):
        source = TokenFileSource(data, seed, vocab_size)
    elif vocab_size < 256:
        raise DataError(f"--data {data}: a text file is read as bytes (256 token ids); the model's vocab_size="
                        f"{vocab_size} is smaller (choose a model with vocab_size >= 256, e.g. --model small)")
    else:
        source = TextSource(data, seed)
    return source.require(seq_len) if seq_len is not None else source
