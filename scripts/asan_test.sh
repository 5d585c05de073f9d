#!/usr/bin/env bash
# Builds the readers' test suites (and the io_uring reader's, the tokenizers' and the chat formats') with
# AddressSanitizer + UndefinedBehaviorSanitizer and runs them: every corrupt-input test must be rejected cleanly,
# without a sanitizer report.
# Usage: scripts/asan_test.sh [BUILD_DIR] (default build-asan)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-asan}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DNFLASH_SANITIZE=ON -DNFLASH_BUILD_BENCHMARKS=OFF >/dev/null
TARGETS="core_tests gguf_tests quant_kernel_tests converter_tests profile_tests packer_tests planner_tests direct_io_tests"
TARGETS="$TARGETS text_tests"
cmake --build "$BUILD" -j "$(nproc)" --target $TARGETS
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for t in $TARGETS; do "$BUILD/tests/$t" --gtest_brief=1; done
