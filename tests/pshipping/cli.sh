#!/usr/bin/env bash
# cli.sh - policy shipping and auditing end to end with the real binaries:
# fedinfer keygen, fedinfer coordinator --init (operator and policy-signing
# key) and the coordinator, fedctl policy apply / history / diff / rollback
# / bundle and fedctl audit [verify] over the fabric, with the operator's
# configuration only (fedctl never opens the coordinator's files), and the
# offline tools checking what came back (bundle install with the pinned
# signing key); then kill -9 and a restart keep the versions.
set -euo pipefail
FEDINFER=$1
FEDCTL=$2
T=$(mktemp -d)
COORD=""
trap 'if [ -n "$COORD" ]; then kill $COORD 2>/dev/null || true; fi; rm -rf "$T"' EXIT
cd "$T"
fail() { echo "pshipping cli: $*"; for f in out.txt err.txt coord.log; do [ -f $f ] && { echo "--- $f"; cat $f; }; done; exit 1; }

"$FEDINFER" keygen coord >/dev/null
"$FEDINFER" keygen op >/dev/null
# below the ephemeral range (32768-60999 here): a client connecting there
# before the server binds can connect to itself (TCP self-connect: ZeroMQ
# retries the connect, each time from a new ephemeral port) and hold the
# port, and the server's bind then fails (seen: 1 run in 50 under load)
PORT=$((20000 + RANDOM % 12000))
cat > coord.conf <<CONF
db = $T/coord.db
secret_key = $T/coord.key
bind = tcp://127.0.0.1:$PORT
enrol_bind = tcp://127.0.0.1:$((PORT + 1))
heartbeat_ms = 100
liveness = 3
CONF
"$FEDINFER" coordinator --config coord.conf --init --operator-key op.pub > out.txt
grep -q "policy-signing key $T/coord.db.policy.key written" out.txt || fail "--init made no signing key"
[ "$(stat -c %a coord.db.policy.key)" = 600 ] || fail "signing key is not 0600"
[ -s coord.db.policy.key.pub ] || fail "no public signing key"
"$FEDINFER" coordinator --help | grep -q "policy_key" || fail "coordinator --help lacks policy_key"
"$FEDINFER" coordinator --config coord.conf 2>coord.log &
COORD=$!
cat > ctl.conf <<CONF
coordinator = tcp://127.0.0.1:$PORT
coordinator_key = $T/coord.pub
secret_key = $T/op.key
CONF
export FEDCTL_CONFIG=$T/ctl.conf
for _ in $(seq 50); do "$FEDCTL" status >/dev/null 2>&1 && break; sleep 0.1; done

cat > v1.policy <<'POL'
labels public, phi;
jurisdiction EU;
region eu-central in EU;
site berlin-clinic in eu-central;
cluster fra-gpu-1 in eu-central;
permit "public anywhere" when request.labels <= ["public"];
permit "phi on site" when "phi" in request.labels and target == request.origin.site;
POL
sed 's/permit "phi on site".*/permit "phi in the EU" when target within "EU";/' v1.policy > v2.policy
printf 'labels public;\npermit "x" when "secret" in request.labels;\n' > bad.policy

"$FEDCTL" policy apply v1.policy -m "first policy" > out.txt 2>err.txt || fail "apply v1"
grep -q "applied v1.policy as version 1" out.txt || fail "apply v1 output"
if "$FEDCTL" policy apply bad.policy -m "broken" > out.txt 2>err.txt; then fail "bad policy accepted"; fi
grep -q "policy refused: 1 error" err.txt || fail "no checker message"
grep -q "secret" err.txt || fail "checker message does not name the label"
"$FEDCTL" policy diff v2.policy > out.txt 2>err.txt || fail "diff"
grep -q "compared with the active version 1 at the coordinator" out.txt || fail "diff: not against the coordinator"
grep -q "+ opens  phi from berlin-clinic to fra-gpu-1" out.txt || fail "diff: flow not listed"
grep -q "0 audited request(s) replayed" out.txt || fail "diff: replay"
"$FEDCTL" policy apply v2.policy -m "phi in the EU" > out.txt 2>err.txt || fail "apply v2"
grep -q "as version 2" out.txt || fail "apply v2 output"
# A not-after in the past (0 included) or a date that does not exist is refused, not signed for 30 days.
for t in 0 1970-01-01 2020-01-01 2030-02-31 2030-01-01T25:00:00Z; do
  if "$FEDCTL" policy apply v2.policy -m "x" --not-after "$t" > out.txt 2>err.txt; then fail "--not-after $t accepted"; fi
  grep -q -e "not in the future" -e "bad time" err.txt || fail "--not-after $t: no message"
done
"$FEDCTL" policy rollback 1 -m "too wide" > out.txt 2>err.txt || fail "rollback"
grep -q "restored the content of version 1 as version 3" out.txt || fail "rollback output"
"$FEDCTL" policy history > out.txt 2>err.txt || fail "history"
FPR=$("$FEDCTL" status | awk '$1 == "operator" { print $2 == "-" ? $4 : $2 }')
[ "$(grep -c "$FPR" out.txt)" = 3 ] || fail "history does not name the operator's fingerprint $FPR"
grep -q "first policy" out.txt && grep -q "rollback to version 1: too wide" out.txt || fail "history comments"
# The active bundle, fetched over the fabric, installs at an edge that pins
# the coordinator's signing key; its content is version 1's.
"$FEDCTL" policy bundle --out active.bundle > out.txt 2>err.txt || fail "bundle"
grep -q "version 3 bundle written" out.txt || fail "bundle output"
mkdir edge
"$FEDCTL" policy install active.bundle --dir edge --trust coord.db.policy.key.pub > out.txt 2>err.txt || fail "install"
"$FEDCTL" policy bundle --content --out active.policy > /dev/null 2>err.txt || fail "bundle --content"
cmp -s active.policy v1.policy || fail "version 3 does not carry version 1's content"
# Audit: empty and intact; offline mode still reads a local file.
"$FEDCTL" audit verify > out.txt 2>err.txt || fail "audit verify"
grep -q "intact: 0 records" out.txt || fail "audit verify output"
"$FEDCTL" audit --since 2020-01-01 --label phi > out.txt 2>err.txt || fail "audit"
"$FEDCTL" audit verify --db coord.db.audit > out.txt 2>err.txt || fail "audit verify --db (offline)"
for v in "policy apply" "policy history" "policy rollback" "policy diff" "policy bundle" "audit" "audit verify"; do
  "$FEDCTL" $v --help > out.txt || fail "$v --help"
  grep -q -- "--config FILE" out.txt || fail "$v --help lacks --config"
done
# A wrong operator key is refused at the handshake.
"$FEDINFER" keygen stranger >/dev/null
sed "s|$T/op.key|$T/stranger.key|" ctl.conf > stranger.conf
cat >> stranger.conf <<CONF
timeout_ms = 500
CONF
if "$FEDCTL" policy history --config stranger.conf > out.txt 2>err.txt; then fail "unknown key served"; fi
grep -q "stored policy version 3" coord.log || fail "coordinator log"
# kill -9 and restart: the versions are still there, the bundle is the same.
kill -9 $COORD; wait $COORD 2>/dev/null || true
"$FEDINFER" coordinator --config coord.conf 2>>coord.log &
COORD=$!
for _ in $(seq 50); do "$FEDCTL" policy history > out.txt 2>err.txt && break; sleep 0.1; done
[ "$(grep -c "$FPR" out.txt)" = 3 ] || fail "history lost in the restart"
"$FEDCTL" policy bundle --out again.bundle > /dev/null 2>err.txt || fail "bundle after restart"
cmp -s again.bundle active.bundle || fail "active bundle changed in the restart"
"$FEDCTL" audit verify > out.txt 2>err.txt || fail "audit verify after restart"
# A clean stop exits 0 (in the sanitizer build: no leak reported at exit).
kill $COORD; RC=0; wait $COORD || RC=$?; COORD=""
[ $RC = 0 ] || fail "coordinator exited with $RC after SIGTERM"
echo "pshipping cli: ok"
