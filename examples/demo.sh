#!/usr/bin/env bash
# demo.sh - the main job: set up, build, and ask the default model a question.
#
#   examples/demo.sh                      # the default question
#   examples/demo.sh "Why is the sky blue?"
set -euo pipefail
cd "$(dirname "$0")/.."
examples/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target fedinfer >/dev/null
question=${1:-"What is federated inference, in two sentences?"}
echo "> $question"
build/fedinfer run --temp 0 --max-tokens 128 --stats "$question"
