#!/usr/bin/env bash
# Builds nflash (Release) and runs the default test suites (labels unit and integration; `slow` is excluded).
# Usage: scripts/test.sh [BUILD_DIR]   (default: build). Extra ctest arguments: CTEST_ARGS="-L slow" scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
JOBS=$(nproc)
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j "$JOBS"
ctest --test-dir "$BUILD" -j "$JOBS" --output-on-failure --timeout 600 ${CTEST_ARGS:--L "unit|integration"}
