#!/usr/bin/env bash
# The test suite: set up ./.venv if needed, then run pytest on two worker processes
# (pytest-xdist, an idle worker taking tests queued on the other; pass -n 0 to run in this
# process, -n N for N workers).
. "$(dirname "$0")/env.sh"
exec python -m pytest -q -n 2 --dist worksteal "$@"
