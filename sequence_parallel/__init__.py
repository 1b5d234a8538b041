"""Context parallelism: ring attention (zig-zag balanced) and Ulysses all-to-all, and the
transform that puts them into the reference GPT. (Megatron's "sequence parallelism" is
part of tensor parallelism.) Names are loaded on first use (PEP 562)."""
import importlib

_EXPORTS = {
    "BALANCES": "balance", "chunks_of": "balance", "positions": "balance", "check_sequence": "balance",
    "ring_attention": "ring", "RingAttention": "ring", "block_attention": "ring", "ring_forward": "ring",
    "ulysses_attention": "ulysses", "UlyssesAttention": "ulysses",
    "IMPLEMENTATIONS": "balance", "parallelize_context": "plan", "shard_sequence": "plan",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
