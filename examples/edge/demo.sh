#!/usr/bin/env bash
# demo.sh - the EU hospital example on one machine: a coordinator, a GPU
# cluster worker (fra-gpu-1), and two edge agents (berlin-clinic in
# eu-central, paris-clinic in eu-west), all on loopback and each enrolled
# with its own CURVE key. A handful of labelled requests go to the edges;
# for each the demo prints where it was processed, under which rule, and
# the reply. Then everything stops cleanly.
#
#   examples/edge/demo.sh            # set up, build, run
#   KEEP=1 examples/edge/demo.sh     # keep the temporary directory (logs, audit logs)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
examples/setup.sh
if [ ! -x build/fedinfer ] || [ ! -x build/fedctl ]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build -j"$(nproc)" --target fedinfer fedctl >/dev/null
fi
FI=$ROOT/build/fedinfer
CTL=$ROOT/build/fedctl
MODEL=${FEDINFER_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}
POLICY=$ROOT/examples/policies/eu-hospital.policy
T=$(mktemp -d)
PIDS=()
stop_all() {
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill -TERM "${PIDS[$i]}" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
trap 'stop_all; [ -n "${KEEP:-}" ] && echo "state kept in $T" || rm -rf "$T"' EXIT
cd "$T"
. "$ROOT/examples/ports.sh" # port: a free port below the ephemeral range
FABRIC=$(port); ENROL=$(port)

echo "== keys, coordinator, policy"
for k in coord op fra-gpu-1 berlin-clinic paris-clinic; do "$FI" keygen "$k" >/dev/null; done
cat > coordinator.conf <<CONF
db = $T/coordinator.db
secret_key = $T/coord.key
bind = tcp://127.0.0.1:$FABRIC
enrol_bind = tcp://127.0.0.1:$ENROL
policy_check_key = $T/sign.key.pub
CONF
"$FI" coordinator --config coordinator.conf --init --operator-key op.pub 2>/dev/null
"$CTL" policy keygen --out sign.key >/dev/null
"$CTL" policy apply "$POLICY" -m "demo" --store coordinator.db --key sign.key --bundle-out v1.bundle >/dev/null
"$FI" coordinator --config coordinator.conf 2>coordinator.log &
PIDS+=($!)
cat > fedctl.conf <<CONF
coordinator = tcp://127.0.0.1:$FABRIC
coordinator_key = $T/coord.pub
secret_key = $T/op.key
CONF
export FEDCTL_CONFIG=$T/fedctl.conf

# Every process that loads the model pins its digest: a different file
# (another version, a damaged copy) is refused at start, naming both.
MODEL_SHA256=$(sha256sum "$MODEL" | cut -d' ' -f1)

echo "== cluster fra-gpu-1"
TOKEN=$("$CTL" enrol --role cluster --site fra-gpu-1 --region eu-central --ttl 300)
cat > shard.conf <<CONF
coordinator = tcp://127.0.0.1:$FABRIC
enrol_endpoint = tcp://127.0.0.1:$ENROL
coordinator_key = $T/coord.pub
secret_key = $T/fra-gpu-1.key
model = $MODEL
model_sha256 = $MODEL_SHA256
model_name = smollm2-135m
site = fra-gpu-1
region = eu-central
threads = 1
n_ctx = 1024
CONF
"$FI" shard --config shard.conf --enrol - <<<"$TOKEN" >shard.log 2>&1 &
PIDS+=($!)

declare -A URL
for edge in berlin-clinic:eu-central paris-clinic:eu-west; do
  site=${edge%%:*}; region=${edge##*:}
  echo "== edge $site ($region)"
  mkdir -p "$site-policy"
  "$CTL" policy install v1.bundle --dir "$site-policy" --trust sign.key.pub >/dev/null
  TOKEN=$("$CTL" enrol --role edge --site "$site" --region "$region" --ttl 300)
  P=$(port)
  cat > "$site.conf" <<CONF
site = $site
region = $region
port = $P
model = $MODEL
model_sha256 = $MODEL_SHA256
model_name = smollm2-135m
threads = 1
n_ctx = 1024
max_tokens = 64
db = $T/$site.db
policy_dir = $T/$site-policy
policy_key = $T/sign.key.pub
coordinator = tcp://127.0.0.1:$FABRIC
coordinator_key = $T/coord.pub
secret_key = $T/$site.key
enrol_endpoint = tcp://127.0.0.1:$ENROL
clusters = fra-gpu-1
CONF
  "$FI" edge --config "$site.conf" --enrol - <<<"$TOKEN" 2>"$site.log" &
  PIDS+=($!)
  URL[$site]=http://127.0.0.1:$P
done

for _ in $(seq 120); do
  for p in "${PIDS[@]}"; do
    kill -0 "$p" 2>/dev/null || { echo "a process exited early; logs:"; tail -n 5 "$T"/*.log; exit 1; }
  done
  up=1
  "$CTL" status 2>/dev/null | grep -q "^cluster.* up " || up=0
  for s in berlin-clinic paris-clinic; do
    curl -sf "${URL[$s]}/healthz" 2>/dev/null | grep -q '"coordinator":true' || up=0
  done
  [ $up = 1 ] && break
  sleep 0.5
done
echo; "$CTL" status; echo

ask() { # site labels model question
  local site=$1 labels=$2 model=$3 q=$4 hdr=""
  [ -n "$labels" ] && hdr="X-Data-Class: $labels"
  curl -s -D h.txt -o b.json "${URL[$site]}/v1/chat/completions" -H "Content-Type: application/json" \
    ${hdr:+-H "$hdr"} -d "{\"model\":\"$model\",\"max_tokens\":24,\"temperature\":0,
      \"messages\":[{\"role\":\"user\",\"content\":\"$q\"}]}" || true
  python3 - "$site" "${labels:-(default)}" <<'PY'
import json, sys
site, labels = sys.argv[1:]
h = {}
status = 0
for line in open("h.txt"):
    if line.startswith("HTTP/"):
        status = int(line.split()[1])
    elif ":" in line:
        k, v = line.split(":", 1)
        h[k.strip().lower()] = v.strip()
b = json.load(open("b.json"))
print(f"--- from {site}, labels {labels}: HTTP {status}")
if status == 200:
    print(f"    processed at {h.get('x-fedinfer-target')} under policy {h.get('x-fedinfer-policy')}"
          f" (labels {h.get('x-fedinfer-labels')}; rule: {h.get('x-fedinfer-rules') or '-'})")
    print("    reply: " + b["choices"][0]["message"]["content"].strip().replace("\n", " ")[:100])
else:
    print(f"    refused: {b['error']['message']}")
PY
}

ask berlin-clinic phi smollm2-135m "Summarise: patient has a mild fever."
ask berlin-clinic "" smollm2-135m "What is the capital of France?"
ask berlin-clinic pii smollm2-135m "Say hello to Anna."
ask berlin-clinic public smollm2-135m "Name a colour."
ask paris-clinic phi smollm2-135m "Summarise: patient has a broken arm."
ask paris-clinic public smollm2-135m "Name a fruit."
ask berlin-clinic phi llama-3-8b "Summarise: patient is well."
ask berlin-clinic nuclear smollm2-135m "hello"

echo
echo "== berlin-clinic's audit log"
"$CTL" audit --db berlin-clinic.db 2>/dev/null || sqlite3 berlin-clinic.db \
  "SELECT seq, request_id, labels, decision, target, rules FROM audit"
echo "== the coordinator's audit log, checked against the head each edge was told (its witness)"
for _ in $(seq 20); do
  "$CTL" audit verify 2>/dev/null | grep -q "witnessed by 2 edge" && break
  sleep 0.5
done
"$CTL" audit verify
"$FI" edge witness --config berlin-clinic.conf
echo "== stopping"
stop_all
echo "stopped cleanly"
