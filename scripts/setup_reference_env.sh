#!/usr/bin/env bash
# Create <repo root>/.venv-ref: Python 3.11 with the PyTorch reference implementation of DeepSeek-V4.1
# (nemo-automodel 0.7.0), CPU torch only, for tests/reference/ (docs/REFERENCE_NOTES.md). Idempotent (a marker
# file holds the requirement set). Usage: bash scripts/setup_reference_env.sh [--force: rebuild];
# DSV41_REF_PYTHON overrides the Python 3.11 interpreter.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REPO_ROOT}/.venv-ref"
MARKER="${VENV}/.dsv41-reference-complete"

# Everything on the path the runner uses. nemo-automodel is installed with --no-deps: its declared deps
# (megatron-fsdp, torchao, datasets, mistral-common, quack-kernels, ...) are not needed by deepseek_v41 on CPU.
# transformers' own deps (huggingface-hub, tokenizers, safetensors, numpy, pyyaml, regex, tqdm, ...) come
# through its normal resolution.
TORCH_REQ="torch==2.13.0"
PKG_REQS=(
  "transformers==5.18.0"
  "tokenizers"
  "safetensors"
  "numpy"
  "pillow"
)
NEMO_REQ="nemo-automodel==0.7.0"
REQ_ID="v1 ${TORCH_REQ} ${PKG_REQS[*]} ${NEMO_REQ}"

if [[ "${1:-}" == "--force" ]]; then
  rm -rf "${VENV}"
elif [[ -f "${MARKER}" && -x "${VENV}/bin/python" ]] && [[ "$(cat "${MARKER}")" == "${REQ_ID}" ]]; then
  echo "reference env already complete: ${VENV}"
  exit 0
fi

pick_python() {
  local cand
  for cand in "${DSV41_REF_PYTHON:-}" python3.11 /root/.pyenv/versions/3.11.7/bin/python3.11; do
    [[ -z "${cand}" ]] && continue
    if command -v "${cand}" >/dev/null 2>&1 \
       && "${cand}" -c 'import sys, venv; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' >/dev/null 2>&1; then
      command -v "${cand}"
      return 0
    fi
  done
  return 1
}

PY="$(pick_python)" || { echo "error: no Python 3.11 found (tried python3.11, /root/.pyenv/versions/3.11.7/bin/python3.11; set DSV41_REF_PYTHON)" >&2; exit 1; }
echo "using ${PY} ($("${PY}" --version 2>&1))"

start=$(date +%s)
rm -f "${MARKER}"
if [[ ! -x "${VENV}/bin/python" ]]; then
  "${PY}" -m venv "${VENV}"
fi
VPY="${VENV}/bin/python"
PIP=("${VPY}" -m pip --disable-pip-version-check --no-input)

# 1) torch, CPU build. The machine's pip config has find-links=/opt/wheels holding torch-2.13.0+cpu (cp311);
# `torch==2.13.0` matches the local `+cpu` build, which pip prefers. Install the wheel file directly when it is
# there, so that nothing can swap in PyPI's multi-GB CUDA build.
TORCH_WHEEL="$(ls /opt/wheels/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -n1 || true)"
if [[ -n "${TORCH_WHEEL}" ]]; then
  "${PIP[@]}" install "${TORCH_WHEEL}"
else
  echo "warning: no local torch-2.13.0+cpu wheel in /opt/wheels; installing ${TORCH_REQ} from the index" >&2
  "${PIP[@]}" install "${TORCH_REQ}"
fi
"${VPY}" - <<'EOF'
import torch, sys
v = torch.__version__
if not v.startswith("2.13.0") or torch.version.cuda is not None:
    sys.exit(f"error: unexpected torch build {v} (cuda={torch.version.cuda}); expected the 2.13.0 CPU build")
print("torch", v, "cpu-only")
EOF

# 2) the rest, with torch pinned so that nothing upgrades it.
echo "torch==$("${VPY}" -c 'import torch; print(torch.__version__)')" > "${VENV}/torch-pin.txt"
"${PIP[@]}" install -c "${VENV}/torch-pin.txt" "${PKG_REQS[@]}"
"${PIP[@]}" install --no-deps "${NEMO_REQ}"

# 3) check the import path the runner uses.
TORCHDYNAMO_DISABLE=1 "${VPY}" - <<'EOF'
import importlib, sys
for m in ["torch", "transformers", "tokenizers", "safetensors", "numpy", "PIL",
          "nemo_automodel.components.models.deepseek_v41.model",
          "nemo_automodel.components.models.deepseek_v41.config",
          "nemo_automodel.components.models.deepseek_v41.state_dict_adapter",
          "nemo_automodel.components.moe.config"]:
    importlib.import_module(m)
print("imports ok")
EOF

echo "${REQ_ID}" > "${MARKER}"
echo "reference env ready: ${VENV} ($(( $(date +%s) - start )) s)"
