# Sourced by the multi-machine tests: "machines" as network namespaces, each with its own address,
# joined by a bridge that lives in a namespace of its own (the host's firewall never sees their
# packets). Needs root and iproute2; skips (exit 77) otherwise.
#   netns_up N        → MACHINE_NS[0..N-1] (namespace names), MACHINE_IP[0..N-1] (10.213.0.1, …)
#   on_machine K CMD  → runs CMD in machine K's namespace
#   cut_link K        → machine K's link goes down (its packets stop both ways)
#   netns_down        → every namespace and link goes (call it from the script's EXIT trap)
if [ "$(id -u)" != 0 ]; then echo "skipped: needs root for ip netns"; exit 77; fi
if ! command -v ip >/dev/null; then echo "skipped: needs iproute2 (ip)"; exit 77; fi
MACHINE_NS=()
MACHINE_IP=()
NETNS_TAG=z$$
NETNS_SWITCH=""
netns_down() {
  local ns
  for ns in "${MACHINE_NS[@]}" $NETNS_SWITCH; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  done
  return 0
}
netns_up() {
  local n=$1 k
  if ! ip netns add "${NETNS_TAG}sw" 2>/dev/null; then echo "skipped: cannot create network namespaces here"; exit 77; fi
  NETNS_SWITCH=${NETNS_TAG}sw
  if ! ip -n "$NETNS_SWITCH" link add br0 type bridge 2>/dev/null; then netns_down; echo "skipped: no bridge"; exit 77; fi
  ip -n "$NETNS_SWITCH" link set br0 up
  for ((k = 0; k < n; k++)); do
    local ns=${NETNS_TAG}m$k
    ip netns add "$ns" || { netns_down; echo "skipped: cannot create network namespaces here"; exit 77; }
    MACHINE_NS+=("$ns")
    MACHINE_IP+=("10.213.0.$((k + 1))")
    ip -n "$NETNS_SWITCH" link add "port$k" type veth peer name eth0 netns "$ns" || { netns_down; echo "skipped: no veth"; exit 77; }
    ip -n "$NETNS_SWITCH" link set "port$k" master br0 up
    ip -n "$ns" addr add "10.213.0.$((k + 1))/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
  done
}
on_machine() { local k=$1; shift; ip netns exec "${MACHINE_NS[$k]}" "$@"; }
cut_link() { ip -n "${MACHINE_NS[$1]}" link set eth0 down; }
