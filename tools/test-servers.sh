#!/usr/bin/env bash
# `make test-servers`: the suite against the servers and the Python users run besides this
# machine's own (RabbitMQ 3.10, Redis 7.0, Python 3.11, which `make test` covers):
#
#   1. Python 3.13 with RabbitMQ 4.0.5 and Redis 8.0.2: the whole `make test` (lint, types,
#      every test) in a Debian 13 root (tools/trixie.sh), in a network namespace of its
#      own where those servers run on the default ports, as the machine's do here. The
#      tests' own private nodes (clusters, TLS, grants) are Debian 13's too.
#   2. Valkey 8.1.1: the integration tests on this machine's Python, with Valkey from the
#      root (private port 6383) as the shared Redis, the machine's RabbitMQ as the broker.
#
# The root is made once (debootstrap and apt, about a minute here) and reused. What is tested is this
# working tree as it is (tracked and untracked files, not ignored ones), copied into the
# root. Everything started here is stopped on every path.
set -euo pipefail
cd "$(dirname "$0")/.."
TRIXIE=tools/trixie.sh
ROOT=${TRIXIE_ROOT:-/var/cache/trtllm-worker/trixie}
PYTHON=${PYTHON:-python3}
SRC=/src

step() { printf '\n== test-servers: %s\n' "$*" >&2; }

copy_tree() {  # the working tree into $ROOT$SRC, keeping the root's own .venv and .tools
    mkdir -p "$ROOT$SRC"
    find "$ROOT$SRC" -mindepth 1 -maxdepth 1 ! -name .venv ! -name .tools -exec rm -rf {} +
    git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' file; do [ -e "$file" ] && printf '%s\0' "$file"; done \
        | tar --null -T - -cf - | tar -xf - -C "$ROOT$SRC"
}

python313() {
    step "Python 3.13, RabbitMQ 4.0, Redis 8.0 (Debian 13 root, make test)"
    copy_tree
    # with the network: install from uv.lock into the root's .venv
    bash "$TRIXIE" run "cd $SRC && make PYTHON=python3.13 .venv/.installed-dev"
    # in a network namespace of its own: Debian 13's servers on 5672 and 6379
    bash "$TRIXIE" netns "cd $SRC && make PYTHON=python3.13 test"
}

valkey() {
    step "Valkey 8.1 (integration tests, this machine's Python and RabbitMQ)"
    # EXIT, not RETURN: under `set -e` a failing pytest leaves the script, not the function
    trap 'bash "$TRIXIE" down valkey' EXIT
    bash "$TRIXIE" up valkey
    make --no-print-directory PYTHON="$PYTHON" .venv/.installed-dev
    WORKER_TEST_REDIS_URL=redis://127.0.0.1:6383/0 \
        .venv/bin/pytest tests/integration -q -p no:cacheprovider
    bash "$TRIXIE" down valkey
    trap - EXIT
}

main() {  # [python313] [valkey]: both when none is named
    local started=$SECONDS
    [ $# -gt 0 ] || set -- python313 valkey
    bash "$TRIXIE" root
    bash "$TRIXIE" versions
    for run in "$@"; do
        case $run in python313 | valkey) "$run" ;; *) echo "unknown run: $run" >&2; exit 2 ;; esac
    done
    step "passed in $((SECONDS - started)) s: $*"
}

main "$@"
