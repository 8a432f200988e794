#!/usr/bin/env bash
# Two machines × two processes: each "machine" is a network namespace joined by a veth pair, and
# each runs its own `zeal launch` of the collective self-check. Needs root and iproute2;
# exits 77 (skipped) otherwise.
set -u
zeal=${1:?usage: two_nodes.sh path/to/zeal}
if [ "$(id -u)" != 0 ]; then echo "skipped: needs root for ip netns"; exit 77; fi
if ! command -v ip >/dev/null; then echo "skipped: needs iproute2 (ip)"; exit 77; fi
tag=z$$
a=${tag}a b=${tag}b
cleanup() { ip netns del "$a" 2>/dev/null; ip netns del "$b" 2>/dev/null; }
trap cleanup EXIT
if ! ip netns add "$a" 2>/dev/null || ! ip netns add "$b" 2>/dev/null; then
  echo "skipped: cannot create network namespaces here"; exit 77
fi
ip link add "${tag}0" netns "$a" type veth peer name "${tag}1" netns "$b" || { echo "skipped: no veth"; exit 77; }
ip -n "$a" addr add 10.213.0.1/24 dev "${tag}0"
ip -n "$b" addr add 10.213.0.2/24 dev "${tag}1"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "${tag}0" up
ip -n "$b" link set "${tag}1" up

common=(--num_machines 2 --num_processes 4 --main_process_ip 10.213.0.1 --main_process_port 29531 --comm_timeout 60)
out=$(mktemp -d)
ip netns exec "$a" "$zeal" test "${common[@]}" --machine_rank 0 >"$out/node0" 2>&1 &
p0=$!
ip netns exec "$b" "$zeal" test "${common[@]}" --machine_rank 1 >"$out/node1" 2>&1 &
p1=$!
wait $p0; s0=$?
wait $p1; s1=$?
echo "--- machine 0 (exit $s0)"; tail -n 5 "$out/node0"
echo "--- machine 1 (exit $s1)"; tail -n 5 "$out/node1"
grep -q "on 4 ranks" "$out/node0" || { echo "machine 0 did not report a 4-rank run"; exit 1; }
grep -q "^\[rank 0\] PASS$" "$out/node0" || { echo "the self-check did not pass"; exit 1; }
[ $s0 = 0 ] && [ $s1 = 0 ]
