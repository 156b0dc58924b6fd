#!/usr/bin/env bash
# `make cluster-up` / `make cluster-down`: a local Redis Cluster (three masters with a
# replica each, ports 7000-7005), a Sentinel-managed master and replica (7100, 7101;
# Sentinel on 27100), from the installed redis-server, and a 3-node RabbitMQ cluster
# (AMQP on 5701-5703, tools/rabbitmq-cluster.sh), all in .clusters/. Stopped by their
# own ports and node names; the shared Redis on 6379 and RabbitMQ on 5672 are never
# touched.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD/.clusters"
CLUSTER_PORTS=(7000 7001 7002 7003 7004 7005)
MASTER=7100 REPLICA=7101 SENTINEL=27100
RABBITMQ_PORTS=(5701 5702 5703)

answers() { redis-cli -p "$1" ping 2>/dev/null | grep -q PONG; }

wait_for() {  # port what
    for _ in $(seq 100); do answers "$1" && return 0; sleep 0.1; done
    echo "clusters: $2 on port $1 does not answer" >&2; return 1
}

node() {  # port [args...]
    local port=$1; shift
    mkdir -p "$ROOT/$port"
    redis-server --port "$port" --bind 127.0.0.1 --dir "$ROOT/$port" --save "" \
        --appendonly no --daemonize yes --logfile "$ROOT/$port/redis.log" "$@"
    wait_for "$port" "redis-server"
}

up() {
    for port in "${RABBITMQ_PORTS[@]}"; do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "clusters: port $port is taken (make cluster-down?)" >&2; exit 1
        fi
    done
    for port in "${CLUSTER_PORTS[@]}" $MASTER $REPLICA $SENTINEL; do
        if answers "$port"; then echo "clusters: port $port is taken (make cluster-down?)" >&2; exit 1; fi
    done
    for port in "${CLUSTER_PORTS[@]}"; do
        node "$port" --cluster-enabled yes --cluster-config-file "$ROOT/$port/nodes.conf" \
            --cluster-node-timeout 1500
    done
    redis-cli --cluster create $(printf '127.0.0.1:%s ' "${CLUSTER_PORTS[@]}") \
        --cluster-replicas 1 --cluster-yes > "$ROOT/create.log"
    node $MASTER
    node $REPLICA --replicaof 127.0.0.1 $MASTER
    mkdir -p "$ROOT/$SENTINEL"
    cat > "$ROOT/$SENTINEL/sentinel.conf" <<CONF
port $SENTINEL
bind 127.0.0.1
daemonize yes
dir $ROOT/$SENTINEL
logfile $ROOT/$SENTINEL/sentinel.log
sentinel monitor mymaster 127.0.0.1 $MASTER 1
sentinel down-after-milliseconds mymaster 2000
sentinel failover-timeout mymaster 10000
CONF
    redis-server "$ROOT/$SENTINEL/sentinel.conf" --sentinel
    wait_for $SENTINEL "redis-sentinel"
    echo "clusters: starting 3 RabbitMQ nodes (about 20 s)"
    bash tools/rabbitmq-cluster.sh up "$ROOT/rabbitmq" "${RABBITMQ_PORTS[@]}"
    cat <<TEXT
Redis Cluster (3 masters, 3 replicas) on 127.0.0.1:7000-7005:
  WORKER_REDIS_URL=redis://127.0.0.1:7000/0
Redis under Sentinel (master 7100, replica 7101, Sentinel 27100):
  WORKER_REDIS_SENTINELS=127.0.0.1:$SENTINEL WORKER_REDIS_SENTINEL_MASTER=mymaster WORKER_REDIS_MIN_REPLICAS=1
  (try a failover: redis-cli -p $SENTINEL sentinel failover mymaster)
RabbitMQ cluster (nodes trtw-5701, trtw-5702, trtw-5703 @localhost):
  WORKER_AMQP_URL=amqp://guest:guest@127.0.0.1:5701/,amqp://guest:guest@127.0.0.1:5702/,amqp://guest:guest@127.0.0.1:5703/
  (stop the first node: bash tools/rabbitmq-cluster.sh stop .clusters/rabbitmq 5701)
Stop them with: make cluster-down
TEXT
}

down() {
    for port in "${CLUSTER_PORTS[@]}" $MASTER $REPLICA $SENTINEL; do
        if answers "$port"; then redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; fi
    done
    bash tools/rabbitmq-cluster.sh down "$ROOT/rabbitmq"
    rm -rf "$ROOT"
    echo "clusters: stopped"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
