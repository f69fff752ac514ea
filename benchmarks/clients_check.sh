#!/usr/bin/env bash
# The benchmark clients people point at OpenAI-compatible servers, against `qlab serve`, unchanged
# (issue 23): guidellm, inference-perf and aiperf, installed from PyPI into throwaway virtual
# environments, each run for SECONDS (default 20) past the gate's capacity, streaming, by
# benchmarks/clients_check.py, which prints a table (docs/benchmarks.md holds the last one).
# inference-perf needs Python >= 3.12: the first found (python3.13, python3.12 on PATH, then pyenv's,
# or $PYTHON312) is used; without one it is skipped and the table says so.
# Usage: bash benchmarks/clients_check.sh [SECONDS]
#        RECORD=tests/data/clients bash benchmarks/clients_check.sh   # also record their first requests
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_="${1:-20}"
PYTHON="${PYTHON:-.venv/bin/python}"   # qlab's own environment (make .venv/.qlab-installed)
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
ARGS=()

version_of() { "$1" -c "import importlib.metadata as m; print(m.version('$2'))"; }

# A venv for a tool: "$1" the interpreter, "$2" the venv's name, then the packages. Prints why not, on failure.
install() {
    local python="$1" name="$2"; shift 2
    "$python" -m venv "$WORK/$name" >/dev/null 2>&1 || { echo "cannot make a venv with $python"; return 1; }
    "$WORK/$name/bin/pip" install --quiet "$@" >"$WORK/$name.log" 2>&1 \
        || { echo "pip install $* failed: $(grep -v '^WARNING' "$WORK/$name.log" | tail -n 1)"; return 1; }
}

echo "clients_check: installing guidellm and aiperf into a throwaway venv (python3) ..." >&2
if why=$(install python3 tools guidellm aiperf); then
    ARGS+=(--guidellm "$WORK/tools/bin/guidellm" --aiperf "$WORK/tools/bin/aiperf"
           --version "guidellm=$(version_of "$WORK/tools/bin/python" guidellm)"
           --version "aiperf=$(version_of "$WORK/tools/bin/python" aiperf)")
    TOKENIZER_PY="$WORK/tools/bin/python"
else
    ARGS+=(--skip "guidellm=$why" --skip "aiperf=$why")
    TOKENIZER_PY=""
fi

PY312="${PYTHON312:-}"
if [ -z "$PY312" ]; then
    for candidate in python3.14 python3.13 python3.12 "$HOME"/.pyenv/versions/3.*/bin/python3; do
        if command -v "$candidate" >/dev/null 2>&1 \
            && "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
            PY312="$candidate"
            break
        fi
    done
fi
if [ -z "$PY312" ]; then
    ARGS+=(--skip "inference-perf=no Python >= 3.12 on this machine (it needs one; set PYTHON312)")
else
    echo "clients_check: installing inference-perf into a throwaway venv ($PY312) ..." >&2
    if why=$(install "$PY312" ip inference-perf); then
        ARGS+=(--inference-perf "$WORK/ip/bin/inference-perf"
               --version "inference-perf=$(version_of "$WORK/ip/bin/python" inference-perf)")
        TOKENIZER_PY="${TOKENIZER_PY:-$WORK/ip/bin/python}"
    else
        ARGS+=(--skip "inference-perf=$why")
    fi
fi

if [ -z "$TOKENIZER_PY" ]; then
    echo "clients_check: no tool could be installed" >&2
    PYTHONPATH=. "$PYTHON" benchmarks/clients_check.py --tokenizer none "${ARGS[@]}"
    exit 1
fi
"$TOKENIZER_PY" benchmarks/byte_tokenizer.py "$WORK/tokenizer" 2>/dev/null
PYTHONPATH=. "$PYTHON" benchmarks/clients_check.py --tokenizer "$WORK/tokenizer" --seconds "$SECONDS_" \
    ${RECORD:+--record "$RECORD"} "${ARGS[@]}"
