"""Zero-copy NumPy views of the tensors that collectives move.

A CPU torch tensor is viewed through `Tensor.numpy()` (no copy: writes into the view
land in the tensor). bfloat16, which NumPy lacks, is viewed as uint16 bit patterns and
widened to float32 only where arithmetic needs it. A tensor on the `meta` device has no
data: it is described (shape, dtype, bytes) so the call is validated and counted, but no
data moves.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes


def _bf16_widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _bf16_narrow(acc: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even exactly as torch does."""
    bits = np.ascontiguousarray(acc, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    rounded[np.isnan(acc)] = 0x7FC0  # the quiet NaN torch produces
    return rounded


def _identity(a):
    return a


def _to_f32(a):
    return a.astype(np.float32)


def _f16_narrow(acc):
    return acc.astype(np.float16)


class Buffer:
    """What a collective needs to know about one tensor argument of one rank."""

    __slots__ = ("array", "shape", "dtype", "itemsize", "device", "obj")

    def __init__(self, array, shape, dtype, itemsize, device, obj):
        self.array = array  # zero-copy view; None for meta tensors (and on the torch backend)
        self.shape = shape
        self.dtype = dtype  # torch-style name: float32, bfloat16, ...
        self.itemsize = itemsize
        self.device = device
        self.obj = obj  # the tensor or array itself

    @property
    def numel(self) -> int:
        return self.array.size if self.array is not None else math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.array.nbytes if self.array is not None else math.prod(self.shape) * self.itemsize

    @property
    def is_meta(self) -> bool:
        return self.device == "meta"

    def widen(self, a):
        """The accumulation dtype view used by reductions (see reduce_op)."""
        if self.dtype == "bfloat16":
            return _bf16_widen(a)
        if self.dtype == "float16":
            return _to_f32(a)
        return a

    def narrow(self, acc):
        if self.dtype == "bfloat16":
            return _bf16_narrow(acc)
        if self.dtype == "float16":
            return _f16_narrow(acc)
        return acc

    def rows(self, start: int, stop: int) -> np.ndarray | None:
        """The view of rows [start, stop) along dim 0."""
        return None if self.array is None else self.array[start:stop]


_TORCH_NAMES = {d: str(d).removeprefix("torch.") for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}
_NUMPY_NAMES = {np.dtype(n): n for n in (
    "float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64",
    "bool", "complex64", "complex128")}


def as_buffer(t, what: str = "tensor", view: bool = True) -> Buffer:
    """Describe `t` (torch tensor or NumPy array) as a Buffer, with a zero-copy NumPy
    view when `view` (the simulated backend) and none otherwise (the torch backend)."""
    if isinstance(t, np.ndarray):
        name = _NUMPY_NAMES.get(t.dtype) or str(t.dtype)
        return Buffer(t, t.shape, name, t.itemsize, "numpy", t)
    if isinstance(t, torch.Tensor):
        dtype = _TORCH_NAMES.get(t.dtype) or str(t.dtype).removeprefix("torch.")
        if t.is_meta or not view:
            return Buffer(None, tuple(t.shape), dtype, t.element_size(), t.device.type, t)
        if not t.is_cpu:
            raise TypeError(
                f"the simulated backend moves CPU or meta tensors; {what} is on {t.device} "
                f"(use backend='torch' for {t.device.type} tensors)"
            )
        d = t.detach() if t.requires_grad else t
        # through DLPack rather than .numpy(), which would mark the storage not resizable
        # (ZeRO-3 resizes the storage of its parameters to free and refill them)
        if dtype == "bfloat16":
            with _disable_current_modes():  # (the probe: not an op of the rank's program)
                arr = np.from_dlpack(d.view(torch.int16)).view(np.uint16)
        else:
            arr = np.from_dlpack(d)
        return Buffer(arr, arr.shape, dtype, arr.itemsize, "cpu", t)
    raise TypeError(f"{what} must be a torch.Tensor or numpy.ndarray, got {type(t).__name__}")
