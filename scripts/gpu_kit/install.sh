#!/usr/bin/env bash
# Runs ON the GPU machine. Joins the vLLM 0.32.0 kit parts gathered in $DK (default /tmp/dk032:
# kit.part-00, kit.part-01, ... and kit.manifest), checks them against the manifest, unpacks them
# into $SITE (default /tmp/site032), and prints the line to export. If the optional nvidia kit's
# parts (nv.part-*, nv.manifest; built with WITH_NVIDIA=1) are there too, it unpacks them into
# $SITE/nvidia, where torch 2.13 finds them before the machine's own nvidia-* libraries.
# Then (unless KIT_CHECK=0) it imports torch, triton and vLLM from $SITE and reports versions, the
# CUDA libraries actually loaded, and vLLM requirements the machine does not meet, and runs
# gpu_ops_check.py (torch ops on the GPU against the CPU; exits 1 if the GPU is there and one fails).
# Safe to run again: a finished unpack is kept (marker files $SITE/.ok-kit, $SITE/.ok-nv).
# PY (default python3) is the machine's Python 3.12, /opt/torch/.venv/bin/python3.
set -euo pipefail
dk="${DK:-/tmp/dk032}"
site="${SITE:-/tmp/site032}"
py="$(command -v "${PY:-python3}")"
env_line="export PYTHONPATH=$site VLLM_USE_FLASHINFER_SAMPLER=0 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1"

unpack() {  # unpack NAME: check $dk/NAME.part-* against $dk/NAME.manifest, extract into $site
  local name=$1 parts want got i f
  local -a files=()
  [ -f "$site/.ok-$name" ] && return 0
  if [ ! -f "$dk/$name.manifest" ]; then
    echo "no $dk/$name.manifest: copy every part of the kit into $dk (the manifest is in the last)" >&2
    return 2
  fi
  parts=$(sed -n 's/^parts=//p' "$dk/$name.manifest")
  want=$(sed -n 's/^sha256=//p' "$dk/$name.manifest")
  for i in $(seq 0 $((parts - 1))); do
    f=$(printf '%s/%s.part-%02d' "$dk" "$name" "$i")
    [ -f "$f" ] || { echo "missing $f (part $((i + 1)) of $parts)" >&2; return 2; }
    files+=("$f")
  done
  got=$(cat "${files[@]}" | sha256sum | cut -d' ' -f1)
  [ "$got" = "$want" ] || { echo "$name parts in $dk don't match $name.manifest: one is damaged or stale" >&2; return 2; }
  mkdir -p "$site"
  cat "${files[@]}" | "$py" -c '
import sys, tarfile
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz") as t:
    if hasattr(tarfile, "fully_trusted_filter"):
        t.extraction_filter = tarfile.fully_trusted_filter
    t.extractall(sys.argv[1])
' "$site"
  touch "$site/.ok-$name"
  echo "unpacked $name ($parts parts) into $site" >&2
}

unpack kit
if ls "$dk"/nv.part-* > /dev/null 2>&1 || [ -f "$dk/nv.manifest" ]; then unpack nv; fi
# cuDNN: the machine's 9.19 is a minor version older than torch 2.13 was built with (9.20), which
# torch refuses on first use unless told; with the nvidia kit, torch gets its own 9.20.
[ -f "$site/.ok-nv" ] && env_line="export PYTHONPATH=$site VLLM_USE_FLASHINFER_SAMPLER=0"

# pip wrote the console scripts (vllm, torchrun, ...) for the build machine's Python.
for f in "$site"/bin/*; do
  [ -f "$f" ] && head -c 2 "$f" | grep -q '^#!' && sed -i "1s|^#!.*python[0-9.]*\$|#!$py|" "$f" || true
done

if [ "${KIT_CHECK:-1}" = 1 ]; then
  # shellcheck disable=SC2086  # the export line's assignments, as words
  env ${env_line#export } "$py" - "$site" <<'EOF' || { echo "$env_line"; exit 1; }
import ctypes, importlib.metadata as md, os, sys
site = os.path.realpath(sys.argv[1])
import torch, triton, torchvision
import vllm
for m in (torch, triton, torchvision, vllm):
    where = os.path.realpath(m.__file__)
    print(f"{m.__name__} {m.__version__} from {os.path.dirname(where)}", "" if where.startswith(site) else "(NOT the kit's)")
ok = vllm.__version__ == "0.32.0" and torch.__version__.startswith("2.13.0") and triton.__version__ == "3.7.1"
maps = {l.split()[-1] for l in open("/proc/self/maps") if "/nvidia/" in l or "libcu" in l or "libnccl" in l}
for lib in sorted(maps):
    print("  loaded", lib)
print("torch.version.cuda", torch.version.cuda, "| cuda available:", torch.cuda.is_available())
for what, get in (
        ("cuBLASLt (runtime)", lambda: ctypes.CDLL("libcublasLt.so.13").cublasLtGetVersion()),
        ("cuDNN runtime/compiled", lambda: (torch._C._cudnn.getRuntimeVersion(), torch._C._cudnn.getCompileVersion())),
        ("NCCL", lambda: torch.cuda.nccl.version())):
    try:
        print(" ", what, get())
    except Exception as e:  # noqa: BLE001
        print(" ", what, "n/a:", repr(e)[:200])
if torch.cuda.is_available():
    print("gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
    for mod in ("vllm._C_stable_libtorch", "vllm.vllm_flash_attn"):
        try:
            __import__(mod); print("import", mod, "ok")
        except Exception as e:
            ok = False; print("import", mod, "FAILED:", repr(e))
# vLLM's own requirements, against what this PYTHONPATH sees
from packaging.requirements import Requirement
left_out = {"flashinfer-python", "torchcodec", "pynvvideocodec", "tilelang", "nvidia-cudnn-frontend",
            "nvtx", "fastsafetensors", "instanttensor", "nvidia-cutlass-dsl", "quack-kernels",
            "tokenspeed-mla", "humming-kernels"}
# the kit has apache-tvm-ffi 0.1.15.post2 as the 0.26 kit had (xgrammar wants >=0.1.11); vLLM's
# ==0.1.11 pin is for flashinfer and tilelang, which are not in the kit
other_on_purpose = {"apache-tvm-ffi"}
bad = []
for r in map(Requirement, md.requires("vllm") or []):
    if r.marker and not r.marker.evaluate({"extra": ""}):
        continue
    name = r.name.lower().replace("_", "-").replace(".", "-")
    try:
        have = md.version(r.name)
    except md.PackageNotFoundError:
        have = None
    if have is None or not r.specifier.contains(have, prereleases=True):
        bad.append(f"{r} (have {have})" + (" [left out of the kit on purpose]" if name in left_out else
                                            " [this version on purpose]" if name in other_on_purpose else ""))
print("vLLM requirements not met here:" if bad else "all of vLLM's requirements are met")
for b in bad:
    print("  ", b)
sys.exit(0 if ok else 1)
EOF
  # torch's GPU code on this GPU, with lazy and with eager module loading
  for mode in LAZY EAGER; do
    # shellcheck disable=SC2086
    (cd /tmp && env ${env_line#export } CUDA_MODULE_LOADING=$mode "$py" "$dk/gpu_ops_check.py") \
      || { echo "$env_line"; exit 1; }
  done
fi
echo "$env_line"
