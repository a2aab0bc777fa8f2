#!/usr/bin/env bash
# Check a built kit (<repo>/.devkit032) on a machine without a GPU, as far as that goes:
#  1. a Python 3.12 virtual environment like the GPU machine ($EMU, default /tmp/gpu_kit_emu: torch
#     2.11.0 with its CUDA 13 nvidia-* wheels, triton 3.6.0, torchvision 0.26.0, transformers
#     5.17.0, ...; verify-machine-like.txt), made once (about 3 GB of downloads);
#  2. every part's files copied into $DK and install.sh run on them, into $SITE, with that
#     environment's Python, exactly as on the GPU machine (its own check imports torch, triton,
#     torchvision and vLLM from $SITE and lists vLLM requirements not met);
#  3. in a fresh interpreter: the kit's torch/triton/torchvision/vLLM shadow the environment's,
#     torch found NCCL in the kit and its other CUDA libraries in the environment's nvidia-*
#     wheels, and the modules that a dense model with FLASH_ATTN, CUDA graphs and ngram/draft/EAGLE
#     speculation imports, import;
#  4. triton 3.7.1 from the kit compiles a kernel to an sm_90 cubin (its LLVM and ptxas, no GPU);
#  5. the kit's CUDA libraries against the kit's NCCL and the environment's (the GPU machine's)
#     other nvidia-* libraries: every symbol they need from cuBLAS, cuDNN, NCCL, cuSPARSELt, ...
#     is there (ldd -r).
# Not checkable here: anything that needs the GPU or its driver (libcuda.so.1): vLLM's own CUDA
# extensions don't load without it, and no kernel runs.
# Usage: bash scripts/gpu_kit/verify_cpu.sh [repo]     (PY312=... to name a Python 3.12)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "${1:-$here/../..}" && pwd)"
kit="$repo/.devkit032"
[ -d "$kit/p1" ] || { echo "no kit in $kit: run scripts/gpu_kit/build.sh first" >&2; exit 2; }

py312="${PY312:-}"
if [ -z "$py312" ]; then
  for c in python3.12 /root/.pyenv/versions/3.12*/bin/python3 /usr/bin/python3.12; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then py312="$c"; break; fi
  done
fi
[ -n "$py312" ] || { echo "no Python 3.12 here (set PY312): the kit is cp312" >&2; exit 2; }

emu="${EMU:-/tmp/gpu_kit_emu}"
if [ ! -f "$emu/.ok" ]; then
  rm -rf "$emu"
  "$py312" -m venv "$emu"
  "$emu/bin/python3" -m pip install -q --disable-pip-version-check --only-binary=:all: \
    -r "$here/verify-machine-like.txt"
  touch "$emu/.ok"
fi
py="$emu/bin/python3"

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
dk="${DK:-$scratch/dk032}"
site="${SITE:-$scratch/site032}"
mkdir -p "$dk"
for p in "$kit"/p[0-9]* "$kit"/n[0-9]*; do [ -d "$p" ] && cp "$p"/* "$dk"/; done
echo "== install.sh (DK=$dk SITE=$site)"
DK="$dk" SITE="$site" PY="$py" bash "$dk/install.sh"

echo "== fresh interpreter: shadowing and dense-path imports"
PYTHONPATH="$site" VLLM_USE_FLASHINFER_SAMPLER=0 "$py" - "$site" "$emu" <<'EOF'
import importlib, os, sys, traceback
site, emu = (os.path.realpath(p) for p in sys.argv[1:3])
assert sys.path.index(site) < min(i for i, p in enumerate(sys.path) if p.startswith(emu)), sys.path
import torch, triton, torchvision, vllm
for m, want in ((torch, "2.13.0"), (triton, "3.7.1"), (torchvision, "0.28.0"), (vllm, "0.32.0")):
    where = os.path.realpath(m.__file__)
    assert where.startswith(site), f"{m.__name__} comes from {where}"
    assert m.__version__.split("+")[0] == want, (m.__name__, m.__version__)
    print(f"ok {m.__name__} {m.__version__} from the kit")
libs = sorted({os.path.realpath(l.split()[-1]) for l in open("/proc/self/maps") if "/nvidia/" in l})
kit = [os.path.basename(l) for l in libs if l.startswith(site)]
machine = [os.path.basename(l) for l in libs if l.startswith(emu)]
nv_kit = {"libcublas.so.13", "libcublasLt.so.13", "libcudnn.so.9", "libcusparseLt.so.0"}  # WITH_NVIDIA
assert len(kit) + len(machine) == len(libs) and "libnccl.so.2" in kit, libs
assert set(kit) <= {"libnccl.so.2"} | nv_kit, kit
print(f"ok torch loaded {' '.join(kit)} from the kit and {len(machine)} CUDA libraries from the "
      f"machine-like environment: {' '.join(machine)}")
import ctypes
print("   cuBLASLt", ctypes.CDLL("libcublasLt.so.13").cublasLtGetVersion(),
      "| cuDNN runtime, compiled", torch._C._cudnn.getRuntimeVersion(), torch._C._cudnn.getCompileVersion(),
      "| NCCL", torch.cuda.nccl.version())
import torch.nn.functional as F
x = torch.randn(4, 8)
assert torch.allclose(F.softmax(x, -1).sum(-1), torch.ones(4))
print("ok torch CPU ops")
mods = """vllm.entrypoints.llm vllm.engine.arg_utils vllm.v1.engine.core vllm.v1.engine.llm_engine
vllm.v1.executor.multiproc_executor vllm.v1.worker.gpu_worker vllm.v1.worker.gpu_model_runner
vllm.v1.worker.gpu.model_runner vllm.v1.attention.backends.flash_attn vllm.model_executor.models.llama
vllm.model_executor.models.registry vllm.v1.sample.sampler vllm.v1.sample.rejection_sampler
vllm.v1.sample.ops.topk_topp_sampler vllm.v1.spec_decode.ngram_proposer vllm.v1.spec_decode.eagle
vllm.v1.spec_decode.draft_model vllm.model_executor.warmup.kernel_warmup vllm.compilation.backends
vllm.compilation.cuda_graph vllm.distributed.parallel_state
vllm.distributed.device_communicators.cuda_communicator vllm.distributed.device_communicators.pynccl
vllm.renderers.chat_utils vllm.entrypoints.openai.api_server""".split()
bad = 0
for m in mods:
    try:
        importlib.import_module(m)
        print("ok import", m)
    except Exception as e:  # noqa: BLE001
        bad += 1
        print("FAILED import", m, "->", repr(e)[:300])
        traceback.print_exc(limit=-3)
from vllm import LLM, SamplingParams  # noqa: F401
fa3 = os.path.join(os.path.dirname(vllm.__file__), "vllm_flash_attn", "_vllm_fa3_C.abi3.so")
assert os.path.exists(fa3), fa3
try:
    importlib.import_module("vllm.vllm_flash_attn")
    print("ok FlashAttention-3 is in the kit and loads")
except ImportError as e:  # without a GPU driver: libcuda.so.1 is missing
    print("ok FlashAttention-3 is in the kit; it can't load here:", str(e)[:160])
sys.exit(1 if bad else 0)
EOF

echo "== triton 3.7.1 (libtriton.so stripped) compiles a kernel for sm_90, here on the CPU"
cat > "$scratch/triton_sm90.py" <<'EOF'  # @triton.jit wants its source in a file
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def add(x, y, o, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(o + i, tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)


sig = {"x": "*fp32", "y": "*fp32", "o": "*fp32", "n": "i32", "BLOCK": "constexpr"}
k = triton.compile(ASTSource(fn=add, signature=sig, constexprs={"BLOCK": 128}),
                   target=GPUTarget("cuda", 90, 32))
assert ".target sm_90" in k.asm["ptx"]
print(f"ok triton {triton.__version__} from {triton.__file__}: {len(k.asm['cubin'])} bytes of sm_90 cubin")
EOF
TRITON_CACHE_DIR="$scratch/triton-cache" PYTHONPATH="$site" "$py" "$scratch/triton_sm90.py"

echo "== symbols the kit's CUDA libraries need from the machine's nvidia-* libraries (ldd -r)"
nvdirs="$(find "$site" "$emu" -path '*/nvidia/*/lib' -type d | tr '\n' ':')"  # the kit's NCCL first
missing=0
for lib in "$site"/torch/lib/libtorch_cuda.so "$site"/torch/lib/libtorch_cuda_linalg.so \
           "$site"/torch/lib/libc10_cuda.so "$site"/torch/lib/libtorch_nvshmem.so \
           "$site"/torch/lib/libtorch_global_deps.so "$site"/torchvision/_C.so \
           "$site"/vllm/_C_stable_libtorch.abi3.so "$site"/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so; do
  [ -f "$lib" ] || continue
  # libcuda.so.1 (the driver) is not here; its cu* symbols, Python's, and torch's own c10 ones
  # (libtorch_nvshmem.so takes them from libc10_cuda.so without naming it; so does the wheel's)
  # are not the point.
  out="$(LD_LIBRARY_PATH="$nvdirs$site/torch/lib" ldd -r "$lib" 2>&1 \
    | grep -E 'undefined symbol|not found' \
    | grep -vE 'libcuda\.so\.1|symbol: (cu[A-Z]|_?Py|_ZN?K?3c10)' || true)"
  if [ -n "$out" ]; then missing=1; echo "$lib:"; echo "$out" | head -20; else echo "ok $(basename "$lib")"; fi
done
[ "$missing" = 0 ] && echo "verify_cpu: all checks passed" || { echo "verify_cpu: unresolved symbols above"; exit 1; }
