"""GPU tests: kernels against their PyTorch references, and NWOR on the real engine with CUDA.

They are skipped without CUDA. With ``TRITON_INTERPRET=1`` (and Triton installed) the kernel
tests run on the CPU through Triton's interpreter, which is how they are debugged off the GPU.
"""

from __future__ import annotations

import pytest
import torch

from vllm_nwor.nwor.kernels._common import HAS_TRITON, INTERPRET

ON_GPU = torch.cuda.is_available() and HAS_TRITON
DEVICE = "cuda" if ON_GPU else "cpu"


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    for item in items:
        if "tests/gpu" not in str(item.fspath):
            continue
        if INTERPRET and HAS_TRITON and item.get_closest_marker("interpretable"):
            continue
        item.add_marker(pytest.mark.skip(reason="needs CUDA (or TRITON_INTERPRET=1 for kernels)"))


def pytest_configure(config):
    config.addinivalue_line("markers", "interpretable: can run under TRITON_INTERPRET=1 on CPU")
