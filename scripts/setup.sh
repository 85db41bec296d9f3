#!/usr/bin/env bash
# Creates .venv (Python 3.12, from .python-version) in the repo root and installs dsv41 with its test extras.
# --test also builds .venv-ref, the Python 3.11 PyTorch reference the equivalence tests compare against.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x .venv/bin/python ]; then
  py=$(command -v python3.12 || true)
  [ -n "$py" ] || { echo "python3.12 not found: install Python 3.12 (pyenv install 3.12) and retry" >&2; exit 1; }
  "$py" -m venv .venv
fi
if [ "${1:-}" = "--test" ]; then  # the reference env builds beside the main install (its own venv)
  bash scripts/setup_reference_env.sh > .venv-ref.log 2>&1 &
  ref_pid=$!
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import dsv41, jax; assert jax.__version__ == '0.11.2', jax.__version__" \
  || { echo "dsv41 did not install into .venv" >&2; exit 1; }
if [ "${1:-}" = "--test" ]; then
  wait "$ref_pid" || { cat .venv-ref.log >&2; echo "building .venv-ref failed (log above)" >&2; exit 1; }
  tail -n 1 .venv-ref.log
  # the tests' probe of the reference (an import of torch and nemo, ~7 s) once here, remembered for every test
  # process (tests/reference/driver.py: reference_available)
  .venv/bin/python -c "from tests.reference.driver import reference_available as ok; assert ok()" \
    || { echo "the reference env does not import nemo's deepseek_v41: rerun scripts/setup_reference_env.sh" >&2; exit 1; }
fi
