#!/usr/bin/env bash
# A local RabbitMQ cluster from the installed rabbitmq-server, for `make cluster-up` and
# the test suite (tests/cluster/test_rabbitmq_cluster.py uses this very script):
#
#   rabbitmq-cluster.sh up DIR PORT...   one node per AMQP port, joined into one cluster
#   rabbitmq-cluster.sh stop DIR PORT    stop one node (and wait until it has exited)
#   rabbitmq-cluster.sh down DIR         stop every node started in DIR, remove DIR
#   rabbitmq-cluster.sh ctl DIR PORT ARGS rabbitmqctl ARGS on one node
#
# Each node is its own: name trtw-PORT@localhost, AMQP on 127.0.0.1:PORT, Erlang
# distribution on PORT+10000, data, logs, config and Erlang cookie under DIR (owned by
# the rabbitmq user, as the server wants), no plugins. The machine's own RabbitMQ
# (rabbit@localhost, /etc/rabbitmq) is never read, joined or stopped: its config and
# environment files are not used, and a node of DIR can only reach nodes with DIR's
# cookie. Ports must lie below the kernel's ephemeral range (32768 and up), where a
# connection's own port can take a listener's port before it binds.
set -euo pipefail
BIN=/usr/lib/rabbitmq/bin

as_rabbitmq() {  # the server refuses to run as root; it runs as rabbitmq, as Debian's does
    if [ "$(id -u)" = 0 ]; then runuser -u rabbitmq -- "$@"; else "$@"; fi
}

ctl() {  # DIR PORT args...: rabbitmqctl for one node, with DIR's cookie (the rabbitmqctl
    # on PATH is a wrapper that, for root, switches to the rabbitmq user and its cookie)
    local dir=$1 port=$2; shift 2
    HOME="$dir" "$BIN/rabbitmqctl" -q -n "trtw-$port@localhost" "$@"
}

start_node() {  # DIR PORT
    local dir=$1 port=$2 node="$1/$2"
    mkdir -p "$node/mnesia" "$node/log"
    echo "ERL_EPMD_ADDRESS=127.0.0.1" > "$node/rabbitmq-env.conf"
    echo "listeners.tcp.default = 127.0.0.1:$port" > "$node/rabbitmq.conf"
    echo "[]." > "$node/enabled_plugins"
    chown -R rabbitmq:rabbitmq "$node"
    as_rabbitmq env -i PATH="$PATH" HOME="$dir" \
        RABBITMQ_CONF_ENV_FILE="$node/rabbitmq-env.conf" \
        RABBITMQ_CONFIG_FILE="$node/rabbitmq.conf" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$node/enabled_plugins" \
        RABBITMQ_NODENAME="trtw-$port@localhost" RABBITMQ_NODE_PORT="$port" \
        RABBITMQ_DIST_PORT=$((port + 10000)) \
        RABBITMQ_MNESIA_BASE="$node/mnesia" RABBITMQ_LOG_BASE="$node/log" \
        RABBITMQ_PID_FILE="$node/pid" \
        ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}" \
        "$BIN/rabbitmq-server" -detached
}

up() {  # DIR PORT...
    local dir=$1; shift
    local first=$1
    mkdir -p "$dir"
    chown rabbitmq:rabbitmq "$dir"
    if ! as_rabbitmq test -x "$dir"; then
        echo "rabbitmq-cluster: the rabbitmq user cannot enter $dir (a parent folder is private)" >&2
        return 1
    fi
    # one cookie for the nodes of DIR (and for rabbitmqctl, which reads it from HOME)
    head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$dir/.erlang.cookie"
    chmod 600 "$dir/.erlang.cookie"
    chown rabbitmq:rabbitmq "$dir/.erlang.cookie"
    for port in "$@"; do start_node "$dir" "$port"; done
    for port in "$@"; do
        if ! ctl "$dir" "$port" wait "$dir/$port/pid" --timeout 90; then
            echo "rabbitmq-cluster: node trtw-$port did not start; see $dir/$port/log" >&2
            return 1
        fi
    done
    shift
    for port in "$@"; do
        ctl "$dir" "$port" stop_app
        ctl "$dir" "$port" join_cluster "trtw-$first@localhost"
        ctl "$dir" "$port" start_app 2>> "$dir/$port/log/start_app.log"  # noise of a join
    done
}

stop_node() {  # DIR PORT: a graceful stop (connections are closed), then wait for exit
    local dir=$1 port=$2 pid
    pid=$(cat "$dir/$port/pid" 2>/dev/null) || return 0
    kill -0 "$pid" 2>/dev/null || return 0
    timeout 60 env HOME="$dir" "$BIN/rabbitmqctl" -q -n "trtw-$port@localhost" \
        stop "$dir/$port/pid" || true
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid"; fi
}

down() {  # DIR: the nodes are stopped side by side
    local dir=$1 port
    [ -d "$dir" ] || return 0
    for pidfile in "$dir"/*/pid; do
        [ -e "$pidfile" ] || continue
        port=$(basename "$(dirname "$pidfile")")
        stop_node "$dir" "$port" &
    done
    wait
    rm -rf "$dir"
}

case "${1:-}" in
    up) shift; up "$@" ;;
    stop) stop_node "$2" "$3" ;;
    down) down "$2" ;;
    ctl) shift; ctl "$@" ;;
    *) echo "usage: $0 up DIR PORT... | stop DIR PORT | down DIR | ctl DIR PORT ARGS..." >&2
       exit 2 ;;
esac
