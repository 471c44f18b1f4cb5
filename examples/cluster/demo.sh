#!/usr/bin/env bash
# demo.sh - a TP=2 shard group on one machine: a coordinator, two ranks of
# `fedinfer shard` splitting the default model between them, and fedctl.
# Shows the group forming, withdrawing its model when a rank is killed and
# coming back when that rank alone is restarted. Sets up and builds what
# is missing (examples/setup.sh, cmake). Everything lives in a temporary
# directory.
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
cd "$T"
. "$ROOT/examples/ports.sh" # port: a free port below the ephemeral range
FABRIC=$(port); ENROL=$(port); L0=$(port); L1=$(port)
for k in coord op rank0 rank1; do "$FI" keygen "$k" >/dev/null; done
cat > coordinator.conf <<CONF
db = $T/coordinator.db
secret_key = $T/coord.key
bind = tcp://127.0.0.1:$FABRIC
enrol_bind = tcp://127.0.0.1:$ENROL
CONF
"$FI" coordinator --config coordinator.conf --init --operator-key op.pub 2>/dev/null
"$FI" coordinator --config coordinator.conf 2>coordinator.log &
cat > fedctl.conf <<CONF
coordinator = tcp://127.0.0.1:$FABRIC
coordinator_key = $T/coord.pub
secret_key = $T/op.key
CONF
export FEDCTL_CONFIG=$T/fedctl.conf

cat > group.conf <<CONF
group = demo-tp2
world = 2
tp = 2
endpoint.0 = tcp://127.0.0.1:$L0
key.0 = rank0.pub
endpoint.1 = tcp://127.0.0.1:$L1
key.1 = rank1.pub
heartbeat_ms = 100
timeout_ms = 1000
CONF
cat > rank0.conf <<CONF
group_file = group.conf
rank = 0
secret_key = rank0.key
model = $MODEL
threads = 1
coordinator = tcp://127.0.0.1:$FABRIC
enrol_endpoint = tcp://127.0.0.1:$ENROL
coordinator_key = coord.pub
model_name = smollm2-135m
site = core-1
region = eu-west
capacity = 4
CONF
cat > rank1.conf <<CONF
group_file = group.conf
rank = 1
secret_key = rank1.key
model = $MODEL
threads = 1
CONF

wait_status() { # pattern: waits until `fedctl status` shows it
  for _ in $(seq 120); do
    "$CTL" status 2>/dev/null | grep -q "$1" && return 0
    sleep 0.25
  done
  echo "timed out waiting for: $1"; tail -n 20 rank*.log; exit 1
}

echo "== rank 0 (the leader) enrols and starts; rank 1 starts"
TOKEN=$("$CTL" enrol --role cluster --site core-1 --region eu-west --ttl 300 2>/dev/null)
"$FI" shard --config rank0.conf --enrol - <<<"$TOKEN" >/dev/null 2>rank0.log &
"$FI" shard --config rank1.conf 2>rank1.log &
R1=$!
wait_status "smollm2-135m(x4)"
"$CTL" status
grep -h "plan\|joined\|available" rank0.log | sed 's/^/  rank0: /'

echo; echo "== kill -9 rank 1: the group withdraws its model"
kill -9 $R1; wait $R1 2>/dev/null || true
for _ in $(seq 40); do "$CTL" status | grep -q "smollm2" || break; sleep 0.25; done
"$CTL" status
tail -n 2 rank0.log | sed 's/^/  rank0: /'

echo; echo "== rank 1 alone restarts: it joins again, the model is announced again"
"$FI" shard --config rank1.conf 2>>rank1.log &
wait_status "smollm2-135m(x4)"
"$CTL" status
tail -n 2 rank0.log | sed 's/^/  rank0: /'
