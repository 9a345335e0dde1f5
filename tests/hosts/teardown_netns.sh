#!/usr/bin/env bash
# Remove what setup_netns.sh built: sshd daemons, namespaces rt-h*, bridge rt-br0, state.
set -uo pipefail
STATE="${RT_NETNS_STATE:-/tmp/ringtrain-netns}"
PREFIX="${RT_NETNS_PREFIX:-rt-h}"
BRIDGE="${RT_NETNS_BRIDGE:-rt-br0}"
for pidfile in "$STATE"/"$PREFIX"*.sshd.pid; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null
done
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$PREFIX[0-9]*\$"); do
    # Anything still running in the namespace belongs to a test: end it.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
    ip netns del "$ns"
done
ip link del "$BRIDGE" 2>/dev/null
rm -rf "$STATE"
echo "removed"
