#!/usr/bin/env bash
# Two machines × two processes: each "machine" is a network namespace (tests/launch/netns.sh), and
# each runs its own `zeal launch` of the collective self-check. Needs root and iproute2; exits 77
# (skipped) otherwise.
set -u
zeal=${1:?usage: two_nodes.sh path/to/zeal}
# shellcheck source=netns.sh
source "$(dirname "$0")/netns.sh"
out=$(mktemp -d)
trap 'netns_down; rm -rf "$out"' EXIT
netns_up 2
common=(--num_machines 2 --num_processes 4 --main_process_ip "${MACHINE_IP[0]}" --main_process_port 29531 --comm_timeout 60)
on_machine 0 "$zeal" test "${common[@]}" --machine_rank 0 >"$out/node0" 2>&1 &
p0=$!
on_machine 1 "$zeal" test "${common[@]}" --machine_rank 1 >"$out/node1" 2>&1 &
p1=$!
wait $p0; s0=$?
wait $p1; s1=$?
echo "--- machine 0 (exit $s0)"; tail -n 5 "$out/node0"
echo "--- machine 1 (exit $s1)"; tail -n 5 "$out/node1"
grep -q "on 4 ranks" "$out/node0" || { echo "machine 0 did not report a 4-rank run"; exit 1; }
grep -q "^\[rank 0\] PASS$" "$out/node0" || { echo "the self-check did not pass"; exit 1; }
[ $s0 = 0 ] && [ $s1 = 0 ]
