# Sourced by the multi-machine tests: "machines" as network namespaces joined by a veth pair (or a
# bridge for three), each with its own address. Needs root and iproute2; skips (exit 77) otherwise.
#   netns_up N        → MACHINE_NS[0..N-1] (namespace names), MACHINE_IP[0..N-1] (10.213.0.1, …)
#   on_machine K CMD  → runs CMD in machine K's namespace
#   cut_link K        → machine K's link goes down (its packets stop both ways)
# The namespaces and links go when the calling script exits (netns_down in its trap).
if [ "$(id -u)" != 0 ]; then echo "skipped: needs root for ip netns"; exit 77; fi
if ! command -v ip >/dev/null; then echo "skipped: needs iproute2 (ip)"; exit 77; fi
MACHINE_NS=()
MACHINE_IP=()
NETNS_TAG=z$$
netns_down() {
  local ns
  for ns in "${MACHINE_NS[@]}"; do ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null; ip netns del "$ns" 2>/dev/null; done
  ip link del "${NETNS_TAG}br" 2>/dev/null
  return 0
}
netns_up() {
  local n=$1 k
  if ! ip link add "${NETNS_TAG}br" type bridge 2>/dev/null; then echo "skipped: cannot create a bridge here"; exit 77; fi
  ip link set "${NETNS_TAG}br" up
  for ((k = 0; k < n; k++)); do
    local ns=${NETNS_TAG}m$k
    if ! ip netns add "$ns" 2>/dev/null; then netns_down; echo "skipped: cannot create network namespaces here"; exit 77; fi
    MACHINE_NS+=("$ns")
    MACHINE_IP+=("10.213.0.$((k + 1))")
    ip link add "${NETNS_TAG}h$k" type veth peer name eth0 netns "$ns" || { netns_down; echo "skipped: no veth"; exit 77; }
    ip link set "${NETNS_TAG}h$k" master "${NETNS_TAG}br" up
    ip -n "$ns" addr add "10.213.0.$((k + 1))/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
  done
}
on_machine() { local k=$1; shift; ip netns exec "${MACHINE_NS[$k]}" "$@"; }
cut_link() { ip -n "${MACHINE_NS[$1]}" link set eth0 down; }
