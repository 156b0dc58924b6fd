#!/usr/bin/env bash
# Debian 13 ("trixie") in a chroot, to run the test suite against newer servers and a newer
# Python than the machine's own: RabbitMQ 4.0, Redis 8.0, Valkey 8.1 and Python 3.13.
#
#   trixie.sh root                 make the root if absent (debootstrap; reused once complete)
#   trixie.sh up rabbitmq|redis|valkey...  start servers from the root on private ports and
#                                  print their URLs; a server already up is left as it is
#   trixie.sh down [NAME...]       stop what `up` started (all if no name)
#   trixie.sh ctl [TOOL] ARGS...   rabbitmqctl (or TOOL: rabbitmq-diagnostics...) for `up`'s node
#   trixie.sh versions             the root's server and Python versions
#   trixie.sh run CMD...           CMD in the root, on the machine's network (pip, uv work)
#   trixie.sh netns CMD...         CMD in the root, in a network namespace of its own (no
#                                  network but its loopback) where RabbitMQ 4.0 on 5672 and
#                                  Redis 8.0 on 6379, fresh ones, run for CMD only
#                                  (TRIXIE_REDIS=valkey: Valkey 8.1 on 6379 instead)
#
# CMD is one string for bash, or a command and its arguments; it runs as root with a clean
# environment (plus the variables named in $TRIXIE_PASS) and exits with CMD's status. The
# test suite: clone into $ROOT/src, then
#   trixie.sh run 'cd /src && make PYTHON=python3.13 .venv/.installed-dev'   # network
#   trixie.sh netns 'cd /src && make PYTHON=python3.13 test'                 # no network
# Root: $TRIXIE_ROOT, default /var/cache/trtllm-worker/trixie. Every chroot runs in its own
# mount and PID namespaces: /proc, /sys, /dev, /dev/shm and /tmp (a fresh tmpfs) are mounted
# there only, and they and every process left in them end with it. `up`: AMQP 127.0.0.1:5682,
# node trixie-rabbit@localhost (distribution port 25682, its own epmd on 4382: the machine's
# broker and its epmd on 4369 are never touched; data wiped at each `up`), Redis 6382, Valkey
# 6383 (no persistence); pid files and logs in $ROOT/var/lib/trixie.
set -euo pipefail

ROOT=${TRIXIE_ROOT:-/var/cache/trtllm-worker/trixie}
MIRROR=${TRIXIE_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${TRIXIE_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
SELF=$(readlink -f "$0")
STAMP=$ROOT/.trixie-complete
STATE=/var/lib/trixie            # inside the root: pid files and logs of `up`
CA=/etc/ssl/certs/ca-certificates.crt
PACKAGES=(python3.13 python3-venv python3-dev python3-pip gcc make git ca-certificates openssl
    rabbitmq-server redis-server redis-sentinel redis-tools valkey-server valkey-tools
    procps iproute2 util-linux netbase less curl)
NODE=trixie-rabbit@localhost AMQP_PORT=5682 DIST_PORT=25682 EPMD_PORT=4382
declare -A PORT=([redis]=6382 [valkey]=6383)
ENVV=(env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
    LANG=C.UTF-8 TERM="${TERM:-dumb}" SSL_CERT_FILE="$CA" PIP_CERT="$CA" REQUESTS_CA_BUNDLE="$CA")
for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY ${TRIXIE_PASS:-}; do
    [ -z "${!v:-}" ] || ENVV+=("$v=${!v}")
done

say() { echo "trixie: $*" >&2; }
die() { say "error: $*"; exit 1; }
die_log() { tail -n 20 "$1" >&2; die "see $1"; }
need_root() { [ -f "$STAMP" ] || die "no complete root at $ROOT: run \`$0 root\` first"; }

sync_host_files() {  # the proxy's CA (apt, pip, git trust it) and DNS, from the machine
    install -D -m 644 "$CA" "$ROOT$CA"
    cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
    printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$ROOT/etc/hosts"
}

make_root() {
    mkdir -p "$(dirname "$ROOT")"; exec 9>"$ROOT.lock"; flock 9   # one build at a time
    if [ -f "$STAMP" ]; then add_missing_packages; say "root ready: $ROOT"; return; fi
    if [ -e "$ROOT" ]; then
        findmnt -rn -o TARGET | grep "^$ROOT/" >/dev/null && die "something is mounted under $ROOT"
        say "removing the half-made root $ROOT"; rm -rf --one-file-system "$ROOT"
    fi
    command -v debootstrap >/dev/null || { say "installing debootstrap";
        apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
    say "debootstrap trixie from $MIRROR (minbase)"
    mkdir -p "$ROOT"
    debootstrap --variant=minbase trixie "$ROOT" "$MIRROR" >"$ROOT.debootstrap.log" 2>&1 ||
        die "debootstrap failed: see $ROOT.debootstrap.log"
    configure_root
    say "apt-get install ${PACKAGES[*]}"
    in_root sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends ${PACKAGES[*]}" >"$ROOT.apt.log" 2>&1 ||
        die "apt-get install failed: see $ROOT.apt.log"
    sync_host_files   # ca-certificates rewrote the bundle without the proxy's CA
    echo "NODENAME=rabbit@localhost" >"$ROOT/etc/rabbitmq/rabbitmq-env.conf"
    mkdir -p "$ROOT$STATE"
    in_root python3.13 -m venv /tmp/venv-check || die "python3.13 -m venv does not work"
    touch "$STAMP"; rm -f "$ROOT.debootstrap.log" "$ROOT.apt.log"
    say "root ready: $ROOT"
}

add_missing_packages() {  # a root made before PACKAGES grew gets what it lacks
    local missing
    # shellcheck disable=SC2016
    mapfile -t missing < <(in_root sh -c \
        'for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done' sh "${PACKAGES[@]}")
    [ ${#missing[@]} -gt 0 ] || return 0
    say "apt-get install ${missing[*]} (new since the root was made)"
    in_root sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends ${missing[*]}" >"$ROOT.apt.log" 2>&1 ||
        die_log "$ROOT.apt.log"
    sync_host_files
    rm -f "$ROOT.apt.log"
}

configure_root() {  # apt sources, the machine's apt proxy settings, no services started
    printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
    chmod 755 "$ROOT/usr/sbin/policy-rc.d"
    printf 'deb %s trixie trixie-updates main\ndeb %s trixie-security main\n' \
        "$MIRROR" "$SECURITY_MIRROR" >"$ROOT/etc/apt/sources.list"
    grep -lis 'Acquire::.*Proxy' /etc/apt/apt.conf /etc/apt/apt.conf.d/* |
        while read -r f; do cp "$f" "$ROOT/etc/apt/apt.conf.d/"; done || true
    sync_host_files
}

mount_root() {  # in a private mount namespace only (the caller's unshare made it)
    mount -t proc proc "$ROOT/proc"
    mount --rbind /sys "$ROOT/sys"
    mount --rbind /dev "$ROOT/dev"
    mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$ROOT/dev/shm"
    mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$ROOT/tmp"
}

in_root() {  # CMD...: CMD in the root, in new mount and PID namespaces (foreground)
    ns_run --mount --pid --fork --kill-child --propagation private -- bash "$SELF" __in-root "$@"
}
ns_run() {  # UNSHARE-ARGS...: unshare in the foreground. Ctrl-C reaches the processes in it
    # directly; TERM or HUP to this script ends them all (unshare itself ignores TERM)
    env --default-signal=INT,QUIT unshare "$@" <&0 &
    NS=$!; local rc=0
    trap ns_term TERM HUP; trap : INT
    while kill -0 "$NS" 2>/dev/null; do rc=0; wait "$NS" || rc=$?; done
    trap - TERM HUP INT; return "$rc"
}
child_of() { local c; c=$(<"/proc/$1/task/$1/children") && c=${c%% *} && [ -n "$c" ] && echo "$c"; }
ns_term() {  # TERM to each process of the namespace but its init, KILL all after 15 s
    local init ns p
    init=$(child_of "$NS") && ns=$(readlink "/proc/$init/ns/pid") &&
        for p in /proc/[0-9]*; do
            [ "$(readlink "$p/ns/pid" 2>/dev/null)" != "$ns" ] || [ "${p#/proc/}" = "$init" ] ||
                kill -TERM "${p#/proc/}" 2>/dev/null || true
        done
    for _ in $(seq 150); do kill -0 "$NS" 2>/dev/null || return 0; sleep 0.1; done
    kill -KILL "$NS" 2>/dev/null || true
}

as_user() {  # USER CMD...: the chroot command line running CMD as the root's USER
    local user=$1; shift
    printf '%q ' chroot "$ROOT" "${ENVV[@]}" HOME="$(getent_root "$user")" \
        setpriv --reuid="$user" --regid="$user" --init-groups env "$@"
}
getent_root() { awk -F: -v u="$1" '$1 == u { print $6 }' "$ROOT/etc/passwd"; }

rabbit_cmd() {  # NODE PORT DIST EPMD DATA: the command line of a RabbitMQ server
    local -a env=(RABBITMQ_NODENAME="$1" RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT="$2"
        RABBITMQ_DIST_PORT="$3" ERL_EPMD_PORT="$4" ERL_EPMD_ADDRESS=127.0.0.1
        RABBITMQ_MNESIA_BASE="$5/mnesia" RABBITMQ_LOG_BASE="$5/log" RABBITMQ_LOGS=-
        ERL_CRASH_DUMP="$5/erl_crash.dump"
        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}")
    as_user rabbitmq "${env[@]}" /usr/lib/rabbitmq/bin/rabbitmq-server
}
redis_cmd() {  # redis|valkey PORT: the command line of a Redis or Valkey server
    as_user "$1" "$1-server" --bind 127.0.0.1 --port "$2" --save "" --appendonly no \
        --dir "/var/lib/$1" --daemonize no
}
fresh_dir() { rm -rf "$ROOT$2"; mkdir -p "$ROOT$2"; chroot "$ROOT" chown -R "$1:$1" "$2"; }

tcp_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
redis_pong() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1" && printf 'PING\r\n' >&3 && IFS= read -r -t 2 r <&3 &&
        [[ $r == +PONG* ]]) 2>/dev/null
}
wait_for() {  # PID SECONDS WHAT CMD...: until CMD succeeds, while PID lives
    local pid=$1 deadline=$((SECONDS + $2)) what=$3; shift 3
    until "$@"; do
        kill -0 "$pid" 2>/dev/null || { say "error: $what exited while starting"; return 1; }
        ((SECONDS < deadline)) || { say "error: $what did not answer in time"; return 1; }
        sleep 0.2
    done
}

serve() {  # CMD-LINE...: pid 1 of the server's namespace: forwards TERM, waits for the server
    mount_root
    eval "$* </dev/null &"
    local child=$! rc=0
    trap 'kill -TERM "$child" 2>/dev/null' TERM INT HUP
    while kill -0 "$child" 2>/dev/null; do wait "$child" || rc=$?; done
    exit "$rc"
}

up_one() {  # NAME: start one server in the background, wait until it answers
    local name=$1 pidf=$ROOT$STATE/$1.pid start=${EPOCHREALTIME/./} cmd pid
    if alive "$(cat "$pidf" 2>/dev/null)"; then say "$name already up"; url "$name"; return; fi
    case $name in
        rabbitmq) fresh_dir rabbitmq "$STATE/rabbitmq"
            cmd=$(rabbit_cmd "$NODE" "$AMQP_PORT" "$DIST_PORT" "$EPMD_PORT" "$STATE/rabbitmq") ;;
        redis|valkey) cmd=$(redis_cmd "$name" "${PORT[$name]}") ;;
        *) die "unknown server '$name' (rabbitmq, redis or valkey)" ;;
    esac
    local port=${PORT[$name]:-$AMQP_PORT}
    tcp_open "$port" && die "127.0.0.1:$port is already in use"
    setsid unshare --mount --pid --fork --kill-child --propagation private -- \
        bash "$SELF" __serve "$cmd" >"$ROOT$STATE/$name.log" 2>&1 </dev/null &
    pid=$!; echo "$pid" >"$pidf"; STARTED+=("$name")
    if [ "$name" = rabbitmq ]; then
        wait_for "$pid" 120 "$name" tcp_open "$port" || die_log "$ROOT$STATE/$name.log"
        ctl rabbitmqctl -q await_startup >/dev/null || die "rabbitmqctl await_startup failed"
    else
        wait_for "$pid" 30 "$name" redis_pong "$port" || die_log "$ROOT$STATE/$name.log"
    fi
    say "$name up in $(((${EPOCHREALTIME/./} - start) / 1000)) ms (pid $pid)"; url "$name"
}
url() {
    case $1 in rabbitmq) echo "amqp://guest:guest@127.0.0.1:$AMQP_PORT/" ;;
        *) echo "redis://127.0.0.1:${PORT[$1]}/0" ;; esac
}
ctl() {  # TOOL ARGS...: a RabbitMQ CLI tool for `up`'s node, as the root's rabbitmq user
    local tool=$1; shift
    in_root HOME=/var/lib/rabbitmq ERL_EPMD_PORT="$EPMD_PORT" setpriv --reuid=rabbitmq \
        --regid=rabbitmq --init-groups "/usr/lib/rabbitmq/bin/$tool" -n "$NODE" "$@"
}
alive() { [ -n "$1" ] && grep -qs "__serve" "/proc/$1/cmdline"; }

down_one() {  # NAME: TERM to the server (pid 1 of its namespace forwards it), wait, else KILL
    local pidf=$ROOT$STATE/$1.pid pid
    [ -f "$pidf" ] || return 0
    pid=$(cat "$pidf")
    if alive "$pid"; then
        kill -TERM "$(child_of "$pid" || echo "$pid")" 2>/dev/null || true
        for _ in $(seq 300); do alive "$pid" || break; sleep 0.1; done
        alive "$pid" && { say "$1 did not stop in 30 s: killing it"; kill -KILL "$pid"; }
        say "$1 down"
    fi
    rm -f "$pidf"
}
STARTED=()
cleanup_failed_up() {  # on EXIT of `up`: a failed `up` stops what it started
    local rc=$?; ((rc == 0)) || for n in "${STARTED[@]}"; do down_one "$n"; done
}
stop_pids() {  # PID...: TERM, then up to 30 s for them to end
    kill -TERM "$@" 2>/dev/null || true
    for _ in $(seq 300); do kill -0 "$@" 2>/dev/null || return 0; sleep 0.1; done
}

netns_inner() {  # CMD...: pid 1 of a fresh network namespace: servers on default ports, CMD
    mount_root
    chroot "$ROOT" ip link set lo up
    local run=/tmp/trixie-netns kv=${TRIXIE_REDIS:-redis} rc=0 rabbit redis
    mkdir -p "$ROOT$run/rabbitmq"; chroot "$ROOT" chown rabbitmq:rabbitmq "$run/rabbitmq"
    eval "$(rabbit_cmd rabbit@localhost 5672 25672 4369 "$run/rabbitmq") \
        >$ROOT$run/rabbitmq.log 2>&1 </dev/null &"
    rabbit=$!
    eval "$(redis_cmd "$kv" 6379) >$ROOT$run/$kv.log 2>&1 </dev/null &"
    redis=$!
    trap 'stop_pids $rabbit $redis' EXIT   # then this pid 1 ends: the kernel kills the rest
    wait_for "$redis" 30 "$kv-server" redis_pong 6379 || die_log "$ROOT$run/$kv.log"
    wait_for "$rabbit" 120 "rabbitmq-server" tcp_open 5672 || die_log "$ROOT$run/rabbitmq.log"
    chroot "$ROOT" "${ENVV[@]}" rabbitmqctl -q await_startup >/dev/null ||
        die "RabbitMQ did not start"
    if [ $# = 1 ]; then set -- bash -c "$1"; fi
    chroot "$ROOT" "${ENVV[@]}" "$@" || rc=$?
    exit "$rc"
}

run_cmd() {  # CMD...
    [ $# -gt 0 ] || die "a command is needed"
    need_root; sync_host_files
    if [ $# = 1 ]; then set -- bash -c "$1"; fi
    in_root "$@"
}

versions() {
    need_root
    in_root sh -c 'dpkg-query -W -f="\${Package} \${Version}\n" rabbitmq-server erlang-base \
        redis-server valkey-server python3.13; python3.13 --version; redis-server --version;
        valkey-server --version; rabbitmqctl version 2>/dev/null || true'
}

main() {
    local cmd=${1:-}; shift || true
    case $cmd in
        __in-root) mount_root; chroot "$ROOT" "${ENVV[@]}" "$@" ;;
        __serve) serve "$@" ;;
        __netns) netns_inner "$@" ;;
        root) make_root ;;
        up) need_root; [ $# -gt 0 ] || die "which server: rabbitmq, redis or valkey"
            trap cleanup_failed_up EXIT; for n in "$@"; do up_one "$n"; done ;;
        down) [ $# -gt 0 ] || set -- rabbitmq redis valkey; for n in "$@"; do down_one "$n"; done ;;
        ctl) need_root; [[ ${1:-} == rabbitmq-* ]] || set -- rabbitmqctl "$@"; ctl "$@" ;;
        versions) versions ;;
        run) run_cmd "$@" ;;
        netns) [ $# -gt 0 ] || die "a command is needed"; need_root
            ns_run --net --mount --pid --fork --kill-child --propagation private -- \
                bash "$SELF" __netns "$@" ;;
        *) sed -n '2,/^set -euo/p' "$SELF" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
    esac
}
main "$@"
