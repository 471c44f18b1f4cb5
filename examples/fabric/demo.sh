#!/usr/bin/env bash
# demo.sh - the fabric on one machine: a coordinator, a cluster worker
# serving the default model, and fedctl. Sets up and builds what is missing
# (examples/setup.sh, cmake). Everything lives in a temporary directory.
#
#   examples/fabric/demo.sh            # worker with the model
#   ECHO=1 examples/fabric/demo.sh     # worker with the echo backend
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
(
  cd "$ROOT"
  examples/setup.sh
  if [ ! -x build/fedinfer ] || [ ! -x build/fedctl ]; then
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build build -j"$(nproc)" --target fedinfer fedctl >/dev/null
  fi
)
FI=$ROOT/build/fedinfer
CTL=$ROOT/build/fedctl
MODEL=${FEDINFER_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}
T=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$T"' EXIT
. "$ROOT/examples/ports.sh" # port: a free port below the ephemeral range
CP=$(port) EP=$(port)       # the coordinator's fabric and enrolment ports
while [ "$EP" = "$CP" ]; do EP=$(port); done
cd "$T"
"$FI" keygen coord; "$FI" keygen op; "$FI" keygen shard1
cat > coordinator.conf <<CONF
db = $T/coordinator.db
secret_key = $T/coord.key
bind = tcp://127.0.0.1:$CP
enrol_bind = tcp://127.0.0.1:$EP
CONF
"$FI" coordinator --config coordinator.conf --init --operator-key op.pub
"$FI" coordinator --config coordinator.conf 2>coordinator.log &
cat > fedctl.conf <<CONF
coordinator = tcp://127.0.0.1:$CP
coordinator_key = $T/coord.pub
secret_key = $T/op.key
CONF
export FEDCTL_CONFIG=$T/fedctl.conf
TOKEN=$("$CTL" enrol --role cluster --site core-1 --region eu-west --ttl 300)
cat > shard.conf <<CONF
coordinator = tcp://127.0.0.1:$CP
enrol_endpoint = tcp://127.0.0.1:$EP
coordinator_key = $T/coord.pub
secret_key = $T/shard1.key
model = $MODEL
model_name = smollm2-135m
site = core-1
region = eu-west
CONF
"$FI" shard --config shard.conf --enrol - ${ECHO:+--echo} <<<"$TOKEN" 2>shard.log &
for _ in $(seq 60); do   # the worker loads the model, then connects
  "$CTL" status | grep -q "^cluster.* up " && break
  sleep 0.5
done
"$CTL" status
echo "--- coordinator log"; cat coordinator.log
echo "--- shard log"; cat shard.log
