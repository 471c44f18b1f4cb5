#!/usr/bin/env bash
# demo.sh - the main job: set up, build, answer one question with the engine,
# then run the EU hospital federation on loopback (a coordinator, a GPU
# cluster worker and two edge agents in two regions): labelled requests go
# to the edges, and for each the demo prints where it was processed, under
# which rule, and the reply; then everything stops cleanly.
#
#   examples/demo.sh                         # the default question
#   examples/demo.sh "Why is the sky blue?"
set -euo pipefail
cd "$(dirname "$0")/.."
examples/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target fedinfer fedctl >/dev/null
question=${1:-"What is federated inference, in two sentences?"}
echo "== the engine alone"
echo "> $question"
build/fedinfer run --temp 0 --max-tokens 96 --stats "$question"
echo
echo "== the federation (examples/edge/demo.sh)"
exec examples/edge/demo.sh
