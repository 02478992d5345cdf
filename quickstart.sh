#!/usr/bin/env bash
# One command for a fresh machine: set everything up, then run the demo or the tests.
#
#   ./quickstart.sh demo     # venv + install + train a small GPT-2 with compressed checkpoints,
#                            #   kill it, resume from a compressed checkpoint, compare the losses
#                            #   with the plain Trainer's, print sizes (~2 minutes)
#   ./quickstart.sh demo-model  # venv + install + compress the real all-MiniLM-L6-v2 and print the table
#   ./quickstart.sh test     # venv + install + the whole test suite (what CI runs)
#   ./quickstart.sh test -m "not slow"   # the quick suite, for every edit
#
# The libraries whose internals we ride on are installed at the versions CI tests (constraints.txt).
# torch 2.13.0 is installed first: on these machines it is a local CPU build, while any other
# torch requirement would pull gigabytes of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")"
what="${1:-demo}"
shift || true
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
case "$what" in
  demo)
    "$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[demo]"
    exec "$VENV/bin/python" examples/trainer_callback.py "$@"
    ;;
  demo-model)
    "$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[demo]"
    exec "$VENV/bin/hf-dynaquant" demo "$@"
    ;;
  test)
    "$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[test]"
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  *)
    echo "usage: $0 demo|demo-model|test [args...]" >&2
    exit 2
    ;;
esac
