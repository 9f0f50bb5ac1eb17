#!/usr/bin/env bash
# Build (or reuse) a CPU-only virtualenv with the real vLLM 0.33.0 in it, and install this
# checkout into it (so its vllm.general_plugins entry point is registered). Prints the
# environment's python as the last line of stdout; everything else goes to stderr.
#
# The recipe of ../shared/baselines/vllm/setup.sh: CPU torch first (pinned, so vLLM's own
# torch==2.14 pin cannot pull a CUDA build), vLLM's wheel with --no-deps (its metadata pulls
# CUDA-only stacks), then only the pure-Python packages vLLM's modules import.
#
# Cached between runs, under ${APP_CI_CACHE:-${XDG_CACHE_HOME:-~/.cache}/app-ci}:
#   - the vLLM wheel (~500 MB from PyPI), downloaded once;
#   - the whole virtualenv, keyed by what goes into it (the pins below) and the python
#     version, reused when its "complete" stamp is there and vLLM still imports (else rebuilt
#     from scratch; environments of other keys are removed then).
# pip's own cache keeps the other wheels. Any failure exits non-zero: CI fails loudly.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
CACHE=${APP_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/app-ci}
VLLM_VERSION=0.33.0
WHEEL_DIR="$CACHE/vllm-wheel"
WHEEL="$WHEEL_DIR/vllm-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl"
TORCH="torch==2.13.0+cpu"
# What vLLM's modules import (versions as verified by the recipe), this package's own
# dependencies, and pytest.
PACKAGES=(
  packaging==26.3 numpy==2.4.6 psutil==7.2.2 pyzmq==27.3.0 urllib3==2.8.0
  regex==2026.11.15 msgspec==0.22.0 pydantic==2.14.3 cbor2==6.2.1 transformers==5.20.2
  aiohttp==3.14.5 requests==2.34.2 certifi==2026.10.18 oss-harmony==0.0.11 openai==3.52.0
  pillow==13.0.0 pybase64==1.5.1 cachetools==8.0.0 cloudpickle==3.1.2 uvloop==0.23.0
  py-cpuinfo==9.0.0 prometheus_client==0.26.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11
  "fastapi>=0.133.0,<0.137.0" partial-json-parser==0.2.1.1.post7
  "llguidance>=1.7.0,<1.8.0" einops==0.8.2
  dependency-injector==4.49.1 attrs==26.1.0 pytest==9.2.0
)
# The cached environment is keyed by what goes into it (and the python that builds it).
KEY=$( (echo "$VLLM_VERSION $TORCH ${PACKAGES[*]}"; "$PYTHON" -c 'import sys; print(sys.version)') \
       | sha256sum | cut -c1-16)
VENV=${APP_CI_VLLM_VENV:-$CACHE/vllm-venv-$KEY}
log() { echo "[vllm-env] $*" >&2; }

mkdir -p "$WHEEL_DIR"
if [ ! -f "$WHEEL" ]; then
  log "downloading vllm==$VLLM_VERSION (once; cached in $WHEEL_DIR)"
  "$PYTHON" -m pip download -q --no-deps -d "$WHEEL_DIR" "vllm==$VLLM_VERSION" >&2
fi

reusable() {
  [ -f "$VENV/.complete" ] && VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c \
    "import torch, vllm.v1.attention.backends.mla.prefill.base" >/dev/null 2>&1
}

if reusable; then
  log "reusing $VENV"
else
  log "building $VENV"
  # Environments of other keys are stale (~1 GB each): keep only this one.
  find "$CACHE" -maxdepth 1 -name 'vllm-venv-*' ! -path "$VENV" -exec rm -rf {} +
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip)
  "${PIP[@]}" install -q --upgrade pip >&2
  # 1) CPU torch, pinned by its local version: never a CUDA build. Where the configured
  #    indexes have no +cpu wheel, take it from the PyTorch CPU index.
  "${PIP[@]}" install -q "$TORCH" >&2 \
    || "${PIP[@]}" install -q --extra-index-url https://download.pytorch.org/whl/cpu \
         "$TORCH" >&2
  # 2) vLLM itself, without its (CUDA) dependencies.
  "${PIP[@]}" install -q --no-deps "$WHEEL" >&2
  # 3) The packages above; the constraint keeps the CPU torch in place.
  CONSTRAINTS="$VENV/constraints.txt"
  echo "$TORCH" > "$CONSTRAINTS"
  "${PIP[@]}" install -q -c "$CONSTRAINTS" "${PACKAGES[@]}" >&2
  VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c \
    "import torch, vllm; assert torch.version.cuda is None, torch.__version__; \
     print('torch', torch.__version__, '| vllm', vllm.__version__)" >&2
  touch "$VENV/.complete"
fi

# This checkout, editable, without dependencies (they are above): registers the entry point.
"$VENV/bin/python" -m pip install -q --no-deps -e . >&2
echo "$VENV/bin/python"
