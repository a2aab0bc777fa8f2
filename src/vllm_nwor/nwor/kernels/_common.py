"""Shared checks for the kernel wrappers: errors name the tensor, never print it."""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: CPU-only installs run the references.
    import triton
    import triton.language as tl
    from triton import knobs

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    knobs = None
    HAS_TRITON = False


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's CPU interpreter: kernels then run on CPU tensors too (used to test kernels here)."""


def use_triton(*tensors: torch.Tensor) -> bool:
    return HAS_TRITON and (INTERPRET or all(t.is_cuda for t in tensors))


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for a host integer (0 for 0, as Triton's). Triton 3.6's is a
    constexpr function: about 2 µs a call from Python, twice per launch, in every layer of a
    step that runs outside CUDA graphs."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


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


class Launcher:
    """Launches a Triton kernel through its compiled form, without the JIT's work per call.

    ``kernel[grid](*args)`` binds the arguments, derives their specialization (each tensor's
    dtype and 16-byte alignment; each integer's being 1 or a multiple of 16), looks the
    compiled kernel up by it and launches: host time that NWOR's kernels paid in every layer of
    every verify step run outside CUDA graphs. Here the caller passes a ``key`` that decides the
    specialization apart from the tensors' alignment: the tensors' dtypes and every integer
    argument not marked ``do_not_specialize`` (the kernel's constexprs follow from them). The
    first launch of a key goes through the JIT, which compiles if it must and returns the
    compiled kernel; later launches of that key whose tensors are all 16-byte aligned, as they
    were for the first, call its launcher directly, each tensor passed as its address. (Given
    a tensor, the launcher calls its ``data_ptr`` and asks the driver whether the address is a
    device's, for every tensor of every launch: host time the commit's launch, with ten
    tensors, saves with addresses; ``benchmarks/tools/nwor_step_host.py`` measures it.)
    Anything else (a tensor not so aligned, a launch hook such as a profiler's) takes the JIT
    every time.

    ``args`` are all of the kernel's arguments in order, constexprs included; its pointer
    arguments are tensors, all on ``args[0]``'s device, and nothing else is.
    """

    def __init__(self, kernel, **options) -> None:
        self.kernel = kernel
        self.options = options
        self._compiled: dict = {}
        self._tensors: tuple[int, ...] = ()  # the positions of the pointer arguments

    def __call__(self, grid: tuple[int, int, int], key: tuple, args: tuple) -> None:
        device = args[0].device.index
        compiled = self._compiled.get((device, key))
        if compiled is not None and not knobs.runtime.launch_enter_hook.calls:
            addressed = self._addressed(args)
            if addressed is not None:
                launch, function, metadata = compiled
                launch(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device),
                       function, metadata, None, None, None, *addressed)
                return
        kernel = self.kernel[grid](*args, **self.options)
        if INTERPRET:
            return
        if not self._tensors:
            self._tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        if self._addressed(args) is not None:
            self._compiled[device, key] = (kernel.run, kernel.function, kernel.packed_metadata)

    def _addressed(self, args: tuple) -> list | None:
        """``args`` with each tensor replaced by its address, or None unless every tensor
        starts on a 16-byte boundary (the compiled kernel's specialization)."""
        addressed, bits = list(args), 0
        for i in self._tensors:
            addressed[i] = address = args[i].data_ptr()
            bits |= address
        return addressed if bits & 15 == 0 else None
