#!/bin/sh
# The GPU check in one command (see gpu_check.py): bash examples/benchmarks/gpu_check.sh [--out FILE]
exec python "$(dirname "$0")/gpu_check.py" "$@"
