#!/usr/bin/env bash
# Build test "hosts" for ringrun's multi-host tests on this one machine (idempotent).
#
# Each host is a network namespace rt-hN with loopback up and one veth (eth0 inside)
# plugged into the bridge rt-br0 in the root namespace; each runs its own sshd on its
# own address. The addresses (10.213.57.0/24) exist only on this bridge and in these
# namespaces: no packet leaves the machine. A throwaway client key, host key and
# known_hosts file live in the state directory.
#
#   bash tests/hosts/setup_netns.sh [NHOSTS]        # default 2: rt-h1 10.213.57.11, rt-h2 .12
#   bash tests/hosts/teardown_netns.sh
#
# RT_NETNS_PREFIX, RT_NETNS_NET and RT_NETNS_BRIDGE (default rt-h, 10.213.57, rt-br0) build
# a second, independent set beside the first (the resize tests use their own, so no other
# test's teardown takes their hosts away).
#
# Prints "ready <state dir>" on success. Needs root, iproute2 and openssh-server.
set -euo pipefail

NHOSTS="${1:-${RT_NETNS_HOSTS:-2}}"
STATE="${RT_NETNS_STATE:-/tmp/ringtrain-netns}"
NET="${RT_NETNS_NET:-10.213.57}"
BRIDGE="${RT_NETNS_BRIDGE:-rt-br0}"
PREFIX="${RT_NETNS_PREFIX:-rt-h}"

die() { echo "setup_netns: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (network namespaces and sshd)"
command -v ip >/dev/null || die "ip not found; apt-get install -y iproute2"
SSHD=$(command -v sshd || echo /usr/sbin/sshd)
[ -x "$SSHD" ] || die "sshd not found; apt-get install -y openssh-server"

mkdir -p "$STATE" /run/sshd
chmod 700 "$STATE"
[ -f "$STATE/id_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C ringtrain-test -f "$STATE/id_ed25519"
[ -f "$STATE/host_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C ringtrain-test-host -f "$STATE/host_ed25519"
cp "$STATE/id_ed25519.pub" "$STATE/authorized_keys"
chmod 600 "$STATE/id_ed25519" "$STATE/host_ed25519" "$STATE/authorized_keys"

if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge || die "cannot create bridge $BRIDGE (kernel refused)"
fi
ip addr replace "$NET.1/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
# Bridged frames must not go through the host firewall (docker-style hosts drop them).
if [ -w /proc/sys/net/bridge/bridge-nf-call-iptables ]; then
    echo 0 > /proc/sys/net/bridge/bridge-nf-call-iptables || true
fi

: > "$STATE/known_hosts.tmp"
for i in $(seq 1 "$NHOSTS"); do
    ns="$PREFIX$i"
    addr="$NET.$((10 + i))"
    if ! ip netns list | grep -qw "$ns"; then
        ip netns add "$ns" || die "cannot create network namespace $ns (kernel refused)"
    fi
    ip -n "$ns" link set lo up
    if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
        ip link del "$ns-br" 2>/dev/null || true
        ip link add "$ns-br" type veth peer name "$ns-in"
        ip link set "$ns-in" netns "$ns"
        ip -n "$ns" link set "$ns-in" name eth0
        ip link set "$ns-br" master "$BRIDGE"
    fi
    ip link set "$ns-br" up
    ip -n "$ns" addr replace "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up

    conf="$STATE/$ns.sshd_config"
    cat > "$conf" <<CONF
ListenAddress $addr
Port 22
HostKey $STATE/host_ed25519
PidFile $STATE/$ns.sshd.pid
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
PrintLastLog no
MaxStartups 100:30:200
LogLevel ERROR
CONF
    pidfile="$STATE/$ns.sshd.pid"
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null \
        && [ "$(ip netns identify "$(cat "$pidfile")" 2>/dev/null)" = "$ns" ]; then
        :  # already running in this namespace
    else
        ip netns exec "$ns" "$SSHD" -f "$conf" -E "$STATE/$ns.sshd.log" || die "sshd did not start in $ns (see $STATE/$ns.sshd.log)"
    fi
    echo "$addr $(cut -d' ' -f1,2 "$STATE/host_ed25519.pub")" >> "$STATE/known_hosts.tmp"
done
mv "$STATE/known_hosts.tmp" "$STATE/known_hosts"

# Every host must reach every other one (rank 0's rendezvous) and the root namespace.
for i in $(seq 1 "$NHOSTS"); do
    for j in $(seq 1 "$NHOSTS"); do
        ok=""
        for _ in $(seq 1 50); do
            if ip netns exec "$PREFIX$i" timeout 1 bash -c "exec 3<>/dev/tcp/$NET.$((10 + j))/22" 2>/dev/null; then
                ok=1; break
            fi
            sleep 0.1
        done
        [ -n "$ok" ] || die "$PREFIX$i cannot reach $NET.$((10 + j)):22"
    done
done
echo "ready $STATE"
