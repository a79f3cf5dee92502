#!/usr/bin/env bash
# The main job: set up ./.venv if needed, then train a small model with boo and eager.
. "$(dirname "$0")/env.sh"
exec python scripts/train_demo.py "$@"
