#!/usr/bin/env python3
"""A quick check that torch's GPU code runs on this GPU: a spread of ops from torch's own kernels
(elementwise, reductions, softmax, sort/topk, scan, indexing, random, embedding, layer norm),
cuBLAS, cuDNN, cuSOLVER/linalg and cuFFT, each compared with the same op on the CPU.

    python3 gpu_ops_check.py [--require-gpu]   # one line per op; exits 1 if any failed

Run it with CUDA_MODULE_LOADING=EAGER as well: then the driver loads every kernel module of every
library when CUDA starts, not only those these ops use. The kit's install.sh and
preflight_sm90.sh run it both ways. On a machine without a GPU it says so and exits 0, or 2
with --require-gpu.
"""

import os
import sys

import torch


def main():
    if not torch.cuda.is_available():
        print("gpu_ops_check: no GPU here, nothing checked")
        return 2 if "--require-gpu" in sys.argv else 0
    torch.manual_seed(0)
    # full fp32 on the GPU (no TF32), so that the CPU comparison can be tight
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda"
    x = torch.randn(257, 129)
    checks = {
        "add_mul": lambda t: t * 2 + 1,
        "sum": lambda t: t.sum(dim=1),
        "softmax": lambda t: torch.softmax(t, dim=-1),
        "sort": lambda t: torch.sort(t, dim=1).values,
        "topk": lambda t: torch.topk(t, 5, dim=1).values,
        "cumsum": lambda t: torch.cumsum(t, dim=1),
        "index_select": lambda t: t.index_select(0, torch.arange(0, 257, 3, device=t.device)),
        "layer_norm": lambda t: torch.nn.functional.layer_norm(t, (129,)),
        "embedding": lambda t: torch.nn.functional.embedding(torch.arange(10, device=t.device), t),
        "matmul_fp32": lambda t: t @ t.T,
        "matmul_bf16": lambda t: (t.bfloat16() @ t.T.bfloat16()).float(),
        "conv2d_cudnn": lambda t: torch.nn.functional.conv2d(
            t[:64, :64].reshape(1, 1, 64, 64), t[:9, :9].reshape(1, 1, 9, 9)
        ),
        "linalg_solve": lambda t: torch.linalg.solve(
            t[:64, :64] + 64 * torch.eye(64, device=t.device), t[:64, :8]
        ),
        "fft": lambda t: torch.fft.rfft(t, dim=1).abs(),
        "argmax": lambda t: torch.argmax(t, dim=1).float(),
    }
    bad = 0
    for name, fn in checks.items():
        try:
            want = fn(x)
            got = fn(x.to(dev)).cpu()
            tol = 5e-2 if "bf16" in name else 1e-3
            ok = torch.allclose(got, want, rtol=tol, atol=tol)
        except Exception as e:  # noqa: BLE001 - report every failure, go on
            ok, want, got = False, None, repr(e)
        if not ok:
            bad += 1
        print(f"  {name:14s} {'ok' if ok else 'FAILED'}" + ("" if ok else f" {str(got)[:200]}"))
    r = torch.rand(1000, device=dev)
    ok = bool(0 <= r.min() and r.max() < 1)
    bad += not ok
    print(f"  {'rand':14s} {'ok' if ok else 'FAILED'}")
    torch.cuda.synchronize()
    print(
        f"gpu_ops_check ({os.environ.get('CUDA_MODULE_LOADING', 'LAZY')} module loading, "
        f"torch {torch.__version__} from {os.path.dirname(torch.__file__)}): "
        f"{len(checks) + 1 - bad} passed, {bad} failed"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
