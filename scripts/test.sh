#!/usr/bin/env bash
# The test suite: set up ./.venv if needed, then run pytest.
. "$(dirname "$0")/env.sh"
exec python -m pytest -q "$@"
