# Sourced by run.sh and test.sh: make ./.venv with boo and its pinned dependencies.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import boo_backend, pytest, xdist" 2>/dev/null; then
    python -m pip install --quiet --upgrade pip
    python -m pip install --quiet -e '.[test]'
fi
