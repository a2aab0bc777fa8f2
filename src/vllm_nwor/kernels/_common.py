"""Shared checks for the kernel wrappers: errors name the tensor, never print it."""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: CPU-only installs run the references.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAS_TRITON = False


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's CPU interpreter: kernels then run on CPU tensors too (used to test kernels here)."""


def use_triton(*tensors: torch.Tensor) -> bool:
    return HAS_TRITON and (INTERPRET or all(t.is_cuda for t in tensors))


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_shape(name: str, tensor: torch.Tensor, shape: tuple) -> None:
    """``shape`` entries of None match any size."""
    ok = tensor.dim() == len(shape) and all(
        want is None or got == want for got, want in zip(tensor.shape, shape, strict=True)
    )
    check(ok, f"{name} has shape {tuple(tensor.shape)}, expected {shape}")


def check_dtype(name: str, tensor: torch.Tensor, *dtypes: torch.dtype) -> None:
    check(tensor.dtype in dtypes, f"{name} has dtype {tensor.dtype}, expected one of {dtypes}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    check(len(set(devices.values())) == 1, f"tensors are on different devices: {devices}")


def check_inner_contiguous(name: str, tensor: torch.Tensor) -> None:
    """The last dim (head_size) must be contiguous; other dims may be strided."""
    check(tensor.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides "
          f"{tuple(tensor.stride())}")
