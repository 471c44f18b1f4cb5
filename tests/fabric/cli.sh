#!/usr/bin/env bash
# cli.sh - the fabric's command line, end to end, with the test-only
# fi_fabric_peer (the same command functions as fedinfer and fedctl):
# keygen, a secret key readable by others refused, coordinator --init,
# fedctl enrol / status / revoke, a worker enrolling with its token.
set -euo pipefail
PEER=$1
T=$(mktemp -d)
trap 'kill $COORD $WORKER 2>/dev/null || true; rm -rf "$T"' EXIT
COORD=""; WORKER=""
cd "$T"
"$PEER" keygen coord >/dev/null
"$PEER" keygen op >/dev/null
"$PEER" keygen worker >/dev/null
[ "$(stat -c %a coord.key)" = 600 ] || { echo "secret key mode is not 0600"; exit 1; }
! "$PEER" keygen coord 2>/dev/null || { echo "keygen overwrote a key without --force"; exit 1; }
# below the ephemeral range (32768-60999 here): a client connecting there
# before the server binds can connect to itself (TCP self-connect: ZeroMQ
# retries the connect, each time from a new ephemeral port) and hold the
# port, and the server's bind then fails (seen: 1 run in 50 under load)
PORT=$((20000 + RANDOM % 12000))
cat > coord.conf <<CONF
# test coordinator
db = $T/coord.db
secret_key = $T/coord.key
bind = tcp://127.0.0.1:$PORT
enrol_bind = tcp://127.0.0.1:$((PORT + 1))
heartbeat_ms = 100
liveness = 3
CONF
echo "bogus = 1" > bad.conf
if "$PEER" coordinator --config bad.conf 2>err.txt; then echo "unknown key accepted"; exit 1; fi
grep -q "bad.conf:1: unknown key 'bogus'" err.txt || { cat err.txt; exit 1; }
chmod 644 coord.key
if "$PEER" coordinator --config coord.conf 2>err.txt; then echo "0644 secret key accepted"; exit 1; fi
grep -q "accessible by others" err.txt || { cat err.txt; exit 1; }
chmod 600 coord.key
"$PEER" coordinator --config coord.conf --init --operator-key op.pub >/dev/null
# a second --init (one that stopped half-way, say) goes on, not refused
"$PEER" coordinator --config coord.conf --init --operator-key op.pub >init2.txt 2>&1 ||
  { echo "a second --init failed:"; cat init2.txt; exit 1; }
grep -q "already recorded" init2.txt || { cat init2.txt; exit 1; }
"$PEER" coordinator --config coord.conf 2>coord.log &
COORD=$!
cat > ctl.conf <<CONF
coordinator = tcp://127.0.0.1:$PORT
coordinator_key = $T/coord.pub
secret_key = $T/op.key
CONF
export FEDCTL_CONFIG=$T/ctl.conf
# A second operator joins with a token the first one made (on stdin).
"$PEER" keygen op2 >/dev/null
cat > ctl2.conf <<CONF
coordinator = tcp://127.0.0.1:$PORT
enrol_endpoint = tcp://127.0.0.1:$((PORT + 1))
coordinator_key = $T/coord.pub
secret_key = $T/op2.key
CONF
OPTOK=$("$PEER" enrol --role operator --ttl 60 2>/dev/null)
"$PEER" join --config ctl2.conf - <<<"$OPTOK" >join.txt 2>&1 || { cat join.txt coord.log; exit 1; }
grep -q "enrolled as operator" join.txt || { cat join.txt; exit 1; }
FEDCTL_CONFIG=$T/ctl2.conf "$PEER" status >/dev/null || { echo "the joined operator is refused"; exit 1; }
TOKEN=$("$PEER" enrol --role cluster --site core1 --region eu-west --ttl 60 2>/dev/null)
[[ $TOKEN == fit_* ]] || { echo "no token: $TOKEN"; exit 1; }
cat > worker.conf <<CONF
coordinator = tcp://127.0.0.1:$PORT
enrol_endpoint = tcp://127.0.0.1:$((PORT + 1))
coordinator_key = $T/coord.pub
secret_key = $T/worker.key
model = none
model_name = smol
site = core1
region = eu-west
heartbeat_ms = 100
CONF
"$PEER" worker --config worker.conf --enrol "$TOKEN" >worker.fpr 2>worker.log &
WORKER=$!
for _ in $(seq 50); do
  "$PEER" status > status.txt 2>/dev/null || true
  grep -q "^cluster.*up.*smol" status.txt && break
  sleep 0.1
done
grep -q "^operator" status.txt || { cat status.txt coord.log; exit 1; }
grep -q "^cluster *core1 *eu-west.*up.*smol(x4)" status.txt || { cat status.txt coord.log; exit 1; }
# The token was for one use: another key cannot take it.
"$PEER" keygen worker2 >/dev/null
sed "s#worker.key#worker2.key#" worker.conf > worker2.conf
if timeout 10 "$PEER" worker --config worker2.conf --enrol "$TOKEN" 2>err.txt; then echo "token reused"; exit 1; fi
grep -q "already" err.txt || { cat err.txt; exit 1; }
# Revoke the worker: it is cut off and its process ends (refused on reconnect).
FPR=$(head -1 worker.fpr)
"$PEER" revoke "$FPR" >/dev/null
for _ in $(seq 50); do kill -0 $WORKER 2>/dev/null || break; sleep 0.1; done
if kill -0 $WORKER 2>/dev/null; then echo "revoked worker still running"; exit 1; fi
WORKER=""
"$PEER" status > status.txt
grep -q "^cluster.*revoked" status.txt || { cat status.txt; exit 1; }
grep -q "revoked $FPR" coord.log || { cat coord.log; exit 1; }
if "$PEER" revoke 00000000000000000000000000000000 2>err.txt; then echo "revoked nothing"; exit 1; fi
grep -q "not_found" err.txt || { cat err.txt; exit 1; }
kill $COORD; wait $COORD || true; COORD=""
echo "cli: ok"
