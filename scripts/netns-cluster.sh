#!/usr/bin/env bash
# A real network on one machine (issue 33): one network namespace per MPI rank, each with a veth pair
# to a bridge (the bridge has no address), its egress shaped by `tc tbf` (and, on the bridge side,
# the traffic towards it), and a launcher namespace on the same bridge from which `mpirun` starts
# every rank inside its own namespace. MPI then talks TCP over those links only.
#
#   scripts/netns-cluster.sh up N --rate MBIT [--ingress-rate MBIT] [--queue-ms MS]  # N ranks (2..64)
#   scripts/netns-cluster.sh run [mpirun options] -- program [args]  # e.g. run -np 4 -- disagmoe train ...
#   scripts/netns-cluster.sh cut RANK [--for SECONDS]                 # take a rank's link down (for a while)
#   scripts/netns-cluster.sh restore RANK                             # bring it back
#   scripts/netns-cluster.sh down                                     # remove everything it made
#   scripts/netns-cluster.sh status                                   # what exists now
#
# Rules it keeps: it needs root and `ip`/`tc` (else it says so and exits 2); it uses only addresses
# of 10.213.7.0/24, inside the namespaces it made (names dm-r0.., dm-l, bridge dmbr0, veths
# dmv-*); `up` first removes what an earlier `up` left, and removes what it made when it fails
# (also on Ctrl-C); `down` is idempotent and waits until the veth ends are gone. netem is not in
# this kernel: delay and loss are not emulated, only rates (tbf).
set -euo pipefail

SUBNET=10.213.7
BRIDGE=dmbr0
STATE=/run/disagmoe-netns
MAX_RANKS=64

die() { echo "netns-cluster: $*" >&2; exit 2; }

need() {
  [ "$(id -u)" -eq 0 ] || die "needs root (it makes network namespaces, veth pairs and a bridge)"
  command -v ip >/dev/null || die "needs iproute2's ip (apt-get install iproute2)"
  command -v tc >/dev/null || die "needs tc (apt-get install iproute2)"
}

# The namespaces and links of an earlier `up` (whatever its size), then the bridge.
down() {
  need
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^dm-(r[0-9]+|l)$' || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -TERM 2>/dev/null || true
    ip netns delete "$ns" 2>/dev/null || true
  done
  local link
  for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^dmv-' || true); do
    ip link delete "$link" 2>/dev/null || true
  done
  ip link delete "$BRIDGE" 2>/dev/null || true
  rm -rf "$STATE"
  # Deleting a namespace frees its veth end asynchronously: wait until nothing of ours is left.
  local i
  for i in $(seq 1 50); do
    if ! ip -o link show 2>/dev/null | grep -qE ': (dmv-|dmbr0)' && ! ip netns list 2>/dev/null | grep -qE '^dm-'; then
      return 0
    fi
    sleep 0.1
  done
  die "links or namespaces still present after 5 s: $(ip -o link show | grep -oE 'dmv-[^:@]*|dmbr0' | tr '\n' ' ')"
}

# tbf on DEV (inside namespace NS, or the root one when NS is empty) at RATE Mbit/s.
shape() {
  local ns="$1" dev="$2" rate="$3"
  # A small bucket: 100 us of traffic at the rate, at least 4 KiB (a real link has no head start
  # after idle; tbf's bucket is one, and a big one lets messages under its size through at the
  # veth's speed: measured with net-bench, a 100 KB bucket at 200 Mbit/s took 16 KiB messages in
  # 0.04 ms instead of 0.65). tbf's timers are high-resolution: the rate holds (192 Mbit/s of
  # payload at 200, against 193 with the 100 KB bucket). A queue of --queue-ms (default 400).
  local burst=$(( rate * 1000000 / 8 / 10000 ))
  [ "$burst" -lt 4096 ] && burst=4096
  local cmd=(tc qdisc replace dev "$dev" root tbf rate "${rate}mbit" burst "$burst" latency "${QUEUE_MS}ms")
  if [ -n "$ns" ]; then ip netns exec "$ns" "${cmd[@]}"; else "${cmd[@]}"; fi
}

# One namespace NS with address ADDR on a veth whose root end, VETH, joins the bridge.
attach() {
  local ns="$1" veth="$2" addr="$3"
  ip netns add "$ns"
  ip link add "$veth" type veth peer name eth0 netns "$ns"
  ip link set "$veth" master "$BRIDGE" up
  ip netns exec "$ns" ip addr add "$addr/24" dev eth0
  ip netns exec "$ns" ip link set lo up
  ip netns exec "$ns" ip link set eth0 up
}

up() {
  local n="" rate="" ingress=""
  QUEUE_MS=400
  while [ $# -gt 0 ]; do
    case "$1" in
      --rate) rate="${2:?--rate needs Mbit/s}"; shift 2 ;;
      --ingress-rate) ingress="${2:?--ingress-rate needs Mbit/s}"; shift 2 ;;
      --queue-ms) QUEUE_MS="${2:?--queue-ms needs milliseconds}"; shift 2 ;;
      [0-9]*) n="$1"; shift ;;
      *) die "up: unknown argument $1 (allowed: N, --rate MBIT, --ingress-rate MBIT, --queue-ms MS)" ;;
    esac
  done
  case "$QUEUE_MS" in ''|*[!0-9]*) die "up: --queue-ms MS, a whole number of milliseconds from 1 to 1000" ;; esac
  { [ "$QUEUE_MS" -ge 1 ] && [ "$QUEUE_MS" -le 1000 ]; } || die "up: --queue-ms $QUEUE_MS (allowed: 1 to 1000)"
  case "$n" in ''|*[!0-9]*) die "up: the number of ranks, from 2 to $MAX_RANKS, comes first" ;; esac
  { [ "$n" -ge 2 ] && [ "$n" -le "$MAX_RANKS" ]; } || die "up: $n ranks (allowed: 2 to $MAX_RANKS)"
  case "$rate" in ''|*[!0-9]*) die "up: --rate MBIT, a whole number of Mbit/s from 1 to 100000" ;; esac
  { [ "$rate" -ge 1 ] && [ "$rate" -le 100000 ]; } || die "up: --rate $rate (allowed: 1 to 100000 Mbit/s)"
  ingress="${ingress:-$rate}"
  case "$ingress" in ''|*[!0-9]*) die "up: --ingress-rate MBIT, a whole number of Mbit/s" ;; esac
  { [ "$ingress" -ge 1 ] && [ "$ingress" -le 100000 ]; } || die "up: --ingress-rate $ingress (allowed: 1 to 100000 Mbit/s)"
  need
  down
  trap 'echo "netns-cluster: up failed; removing what it made" >&2; down' ERR INT TERM
  ip link add "$BRIDGE" type bridge
  ip link set "$BRIDGE" up
  attach dm-l dmv-l "$SUBNET.2"
  local r
  for r in $(seq 0 $((n - 1))); do
    attach "dm-r$r" "dmv-r$r" "$SUBNET.$((10 + r))"
    shape "dm-r$r" eth0 "$rate"
    shape "" "dmv-r$r" "$ingress"
  done
  mkdir -p "$STATE"
  echo "$n $rate $ingress" >"$STATE/cluster"
  cat >"$STATE/rank.sh" <<'EOF'
#!/bin/sh
# Started by mpirun in the launcher namespace: runs the rank inside its own.
rank="${OMPI_COMM_WORLD_RANK:?not started by Open MPI's mpirun}"
exec ip netns exec "dm-r$rank" "$@"
EOF
  chmod +x "$STATE/rank.sh"
  trap - ERR INT TERM
  echo "up: $n ranks at $SUBNET.10-$SUBNET.$((9 + n)), $rate Mbit/s out and $ingress Mbit/s in each; launcher $SUBNET.2"
}

run() {
  need
  [ -f "$STATE/cluster" ] || die "run: no cluster (scripts/netns-cluster.sh up N --rate MBIT first)"
  local opts=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do opts+=("$1"); shift; done
  [ "${1:-}" = "--" ] || die "run: [mpirun options] -- program [arguments], e.g. run -np 2 -- hostname"
  shift
  [ $# -gt 0 ] || die "run: no program after --"
  # mpirun and its daemon live in the launcher namespace; each rank enters its own through the
  # wrapper, keyed on its rank.
  exec ip netns exec dm-l env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    PMIX_MCA_ptl_tcp_remote_connections=1 PMIX_MCA_ptl_tcp_if_include=eth0 \
    mpirun --oversubscribe --mca btl tcp,self --mca btl_tcp_if_include "$SUBNET.0/24" \
    --mca oob_tcp_if_include eth0 -x PMIX_MCA_ptl_tcp_remote_connections -x PMIX_MCA_ptl_tcp_if_include \
    "${opts[@]}" "$STATE/rank.sh" "$@"
}

# The bridge side of rank RANK's veth (checked against the cluster that is up).
rank_link() {
  [ -f "$STATE/cluster" ] || die "no cluster (scripts/netns-cluster.sh up N --rate MBIT first)"
  local n
  n=$(cut -d' ' -f1 "$STATE/cluster")
  case "${1:-}" in ''|*[!0-9]*) die "a rank, from 0 to $((n - 1)), is needed" ;; esac
  [ "$1" -lt "$n" ] || die "rank $1 (allowed: 0 to $((n - 1)))"
  echo "dmv-r$1"
}

# A link fault: rank RANK's veth goes down on the bridge side (its packets are dropped both ways;
# TCP connections stay open and retransmit), for SECONDS then back up, or until `restore`.
cut_link() {
  need
  local link secs=""
  link=$(rank_link "${1:-}")
  shift
  if [ $# -gt 0 ]; then
    [ "$1" = "--for" ] || die "cut: unknown argument $1 (allowed: --for SECONDS)"
    secs="${2:-}"
    case "$secs" in ''|*[!0-9.]*) die "cut: --for SECONDS, a number of seconds (e.g. 2 or 0.5)" ;; esac
  fi
  ip link set "$link" down
  echo "cut: $link down$([ -n "$secs" ] && echo " for $secs s")"
  if [ -n "$secs" ]; then
    trap 'ip link set "$link" up' EXIT
    sleep "$secs"
    ip link set "$link" up
    trap - EXIT
    echo "cut: $link up again"
  fi
}

restore_link() {
  need
  local link
  link=$(rank_link "${1:-}")
  ip link set "$link" up
  echo "restore: $link up"
}

status() {
  ip netns list 2>/dev/null | grep -E '^dm-' || echo "no namespaces of ours"
  ip -br link 2>/dev/null | grep -E '^(dmv-|dmbr0)' || echo "no links of ours"
  [ -f "$STATE/cluster" ] && echo "cluster: $(cat "$STATE/cluster") (ranks, Mbit/s out, Mbit/s in)"
  return 0
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  up) up "$@" ;;
  run) run "$@" ;;
  cut) cut_link "$@" ;;
  restore) restore_link "$@" ;;
  down) down; echo "down: nothing of ours left" ;;
  status) status ;;
  *) die "usage: up N --rate MBIT [--ingress-rate MBIT] [--queue-ms MS] | run [mpirun options] -- program [args] | cut RANK [--for SECONDS] | restore RANK | down | status" ;;
esac
