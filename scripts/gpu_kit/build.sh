#!/usr/bin/env bash
# Build the GPU-machine kit for vLLM 0.32.0 into <repo>/.devkit032 (default repo: the checkout
# that holds this script). Modelled on ../shared/devkit/build.sh (the vLLM 0.26 kit).
#
# The GPU machine has Python 3.12, torch 2.11.0+cu130, triton 3.6.0 and CUDA 13 nvidia-* wheels,
# but no package registry. vLLM 0.32.0 pins torch==2.13.0, so the kit carries torch 2.13.0,
# triton 3.7.1 and torchvision 0.28.0 (the machine's 0.26 does not load against torch 2.13) as
# well as vLLM and the small wheels vLLM imports that the machine lacks (device-requirements.txt).
# Installed into /tmp/site032 and put first on PYTHONPATH, they shadow the machine's copies.
# torch 2.13 is downloaded WITHOUT its nvidia-* wheels: it loads the machine's (torch finds them
# on sys.path when its RPATH comes up empty), except NCCL: torch 2.13 needs NCCL 2.29 (the
# machine has 2.28), so the kit carries nvidia-nccl-cu13==2.29.7. The machine's cuBLAS 13.1.0,
# cuDNN 9.19 and cuSPARSELt 0.8.0 have every symbol torch 2.13 links (torch pins 13.1.1, 9.20,
# 0.8.1); cuDNN's minor version is older than torch was built with, so install.sh's export line
# sets PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1. If those libraries turn out not to work,
# WITH_NVIDIA=1 also builds a second kit with torch 2.13's pins of them (nvidia-requirements.txt),
# in .devkit032/n1..nM; install.sh installs it when its parts are there.
#
# Everything is installed here into one site tree (pip --target, for cp312 manylinux x86_64),
# slimmed, tarred, compressed with xz (-9 by default) and cut into parts of at most KIT_PART_MIB
# (default 44) MiB, so that one part plus the project stays under the 64 MiB a device call carries:
#   .devkit032/p1/kit.part-00, p2/kit.part-01, ..., pN/kit.part-<N-1> + kit.manifest + install.sh
#   + gpu_ops_check.py (2026-11-28: 7 parts, 282 MiB, about 30 minutes on 2 cores)
#
# Left out of vLLM (not used by dense models with FLASH_ATTN on Hopper): FlashAttention-2, the MoE
# ops, the vllm-rs frontend binary, vendored DeepGEMM and the sm100 FMHA, and the model-specific
# FlashMLA, FlashKDA, DeepSelect and QuTLASS extensions. FlashAttention-3 (_vllm_fa3_C) is kept.
# Left out of triton: ptxas-blackwell (sm100+ only), the proton profiler and its CUPTI copy, test libs.
# Left out of torch: bin/protoc. With KIT_STRIP=1 (default) the symbol tables of torch's big
# libraries and the symbol tables and debug info (~280 MiB) of triton's libtriton.so are stripped
# (strip --strip-all: .dynsym, which loading and linking use, stays).
# With KIT_SM90_ONLY=1 (default) fatbin_keep_arch.py blanks the GPU code for other architectures
# than sm_90 (H100/H200) out of every CUDA library in the kit (torch, torchvision, vLLM, NCCL):
# about 465 MiB, mostly already-compressed cubins that xz can't shrink (the kit is 7 parts with
# it, roughly twice that without). preflight_sm90.sh checks the trick on the GPU machine's own
# torch first; KIT_SM90_ONLY=0 builds the full kit.
#
# Environment: KIT_PART_MIB (44), KIT_XZ ("-9 -T0"), KIT_STRIP (1), KIT_SM90_ONLY (1), WITH_NVIDIA (0),
# NVIDIA_ONLY (0: with WITH_NVIDIA=1, rebuild only the n* parts), KIT_CACHE (a folder to keep the
# downloaded wheels in between builds; default: a temporary one).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "${1:-$here/../..}" && pwd)"
out="$repo/.devkit032"
part_mib="${KIT_PART_MIB:-44}"
xz_opts="${KIT_XZ:--9 -T0}"
strip_libs="${KIT_STRIP:-1}"
sm90_only="${KIT_SM90_ONLY:-1}"
with_nvidia="${WITH_NVIDIA:-0}"
nvidia_only="${NVIDIA_ONLY:-0}"
py="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cache="${KIT_CACHE:-$work/cache}"
mkdir -p "$cache"

exclude="$(git -C "$repo" rev-parse --path-format=absolute --git-path info/exclude 2>/dev/null || echo "$repo/.git/info/exclude")"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.devkit032/' "$exclude" 2>/dev/null || echo '/.devkit032/' >> "$exclude"

# cp312, manylinux x86_64 (glibc up to 2.35; the GPU machine has Python 3.12.3 on a newer glibc).
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 5 35); do plat+=(--platform "manylinux_2_${n}_x86_64"); done

stage() {  # stage DIR REQS...: install the cached wheels for REQS into DIR, as on Python 3.12
  local dir=$1; shift
  "$py" -m pip download -q --disable-pip-version-check --no-deps "${plat[@]}" -d "$cache" "$@"
  "$py" -m pip install -q --disable-pip-version-check --no-deps --no-index --find-links "$cache" \
    --no-compile --ignore-requires-python "${plat[@]}" --target "$dir" "$@"
}

pack() {  # pack DIR NAME PREFIX: DIR -> NAME.tar.xz -> NAME.part-NN in $out/PREFIX1.., manifest last
  local dir=$1 name=$2 prefix=$3 i=0 f
  (cd "$dir" && tar --owner=0 --group=0 -cf - .) | xz $xz_opts > "$work/$name.tar.xz"
  local bytes sum
  bytes=$(stat -c %s "$work/$name.tar.xz")
  sum=$(sha256sum "$work/$name.tar.xz" | cut -d' ' -f1)
  split -b "${part_mib}M" -d -a 2 "$work/$name.tar.xz" "$work/$name.part-"
  rm "$work/$name.tar.xz"
  rm -rf "$out/$prefix"[0-9]*
  for f in "$work/$name.part-"*; do i=$((i + 1)); mkdir -p "$out/$prefix$i"; mv "$f" "$out/$prefix$i/"; done
  printf 'parts=%s\nbytes=%s\nsha256=%s\n' "$i" "$bytes" "$sum" > "$out/$prefix$i/$name.manifest"
  last=$i
  echo "$name: $i parts, $bytes bytes ($((bytes / 1048576)) MiB) in $out/${prefix}1..$prefix$i"
}

mkdir -p "$out"
if [ "$nvidia_only" != 1 ]; then
  site="$work/site"
  # NCCL: torch 2.13 links eight functions that NCCL 2.29 added (ncclCommSuspend, ncclSignal,
  # ...), so with the machine's NCCL 2.28 `import torch` fails; the kit carries torch's pin.
  stage "$site" vllm==0.32.0 torch==2.13.0 triton==3.7.1 nvidia-nccl-cu13==2.29.7 \
    -r "$here/device-requirements.txt"
  (
    cd "$site"
    rm -rf vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
      vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 vllm/_flashkda_C.abi3.so \
      vllm/_deepselect_C.abi3.so vllm/_flashmla_C.abi3.so vllm/_flashmla_extension_C.abi3.so \
      vllm/_qutlass_C.abi3.so \
      torch/bin/protoc torch/bin/protoc-* \
      triton/backends/nvidia/bin/ptxas-blackwell triton/backends/nvidia/lib/cupti triton/_C/libproton.so \
      triton/instrumentation/libGPUInstrumentationTestLib.so triton/plugins/libTritonPluginsTestLib.so
    [ -f vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so ] || { echo "vllm wheel has no FlashAttention-3" >&2; exit 1; }
    if [ "$strip_libs" = 1 ]; then
      for f in torch/lib/libtorch_cpu.so torch/lib/libtorch_cuda.so torch/lib/libtorch_cuda_linalg.so \
               torch/lib/libtorch_python.so torch/lib/libc10.so torch/lib/libc10_cuda.so \
               triton/_C/libtriton.so nvidia/nccl/lib/libnccl.so.2; do
        strip --strip-all "$f"
      done
    fi
    find . -name __pycache__ -prune -exec rm -rf {} +
  )
  if [ "$sm90_only" = 1 ]; then
    find "$site" -type f \( -name '*.so' -o -name '*.so.*' \) -print0 \
      | xargs -0 "$py" "$here/fatbin_keep_arch.py" --arch 90 | grep -v ' blanked 0.0 MiB' || true
  fi
  rm -rf "$out"/p[0-9]*
  pack "$site" kit p
  cp "$here/install.sh" "$here/gpu_ops_check.py" "$out/p$last/"
  rm -rf "$site"
fi
if [ "$with_nvidia" = 1 ]; then
  stage "$work/nv" -r "$here/nvidia-requirements.txt"
  find "$work/nv" \( -name '*.a' -o -name include \) -prune -exec rm -rf {} +
  if [ "$sm90_only" = 1 ]; then
    find "$work/nv" -type f \( -name '*.so' -o -name '*.so.*' \) -print0 \
      | xargs -0 "$py" "$here/fatbin_keep_arch.py" --arch 90 | grep -v ' blanked 0.0 MiB' || true
  fi
  pack "$work/nv" nv n
fi
du -sh "$out"/* | sort -V -k2
echo "copy each part's files into /tmp/dk032 (one device call a part), then run bash /tmp/dk032/install.sh"
