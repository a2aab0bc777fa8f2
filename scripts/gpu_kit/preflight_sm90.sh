#!/usr/bin/env bash
# Runs ON the GPU machine, from the project root, in the first device call of a kit install:
#   bash scripts/gpu_kit/preflight_sm90.sh
# The kit's GPU libraries are cut down to sm_90 code by fatbin_keep_arch.py (build.sh's
# KIT_SM90_ONLY=1, the default). This checks that trick on the machine's own torch 2.11 before
# the kit's parts are sent: it copies that torch to /tmp/pf_torch, cuts its libraries the same
# way, and runs gpu_ops_check.py with it, with lazy and with eager CUDA module loading (eager
# makes the driver load every kernel module of every library). If it fails, stop: rebuild the
# kit with KIT_SM90_ONLY=0 (more parts) and send that instead. Takes about a minute.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${PY:-python3}"
src="$("$py" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
dst=/tmp/pf_torch
rm -rf "$dst" && mkdir -p "$dst"
cp -a "$src" "$dst/torch"
"$py" "$here/fatbin_keep_arch.py" "$dst"/torch/lib/*.so* | grep -v ' blanked 0.0 MiB' || true
rc=0
for mode in LAZY EAGER; do
  (cd /tmp && PYTHONPATH="$dst" CUDA_MODULE_LOADING=$mode "$py" "$here/gpu_ops_check.py" --require-gpu) \
    || rc=1
done
rm -rf "$dst"
if [ "$rc" = 0 ]; then echo "preflight_sm90: PASSED"; else echo "preflight_sm90: FAILED (see above; if GPU ops failed, send a KIT_SM90_ONLY=0 kit)"; fi
exit "$rc"
