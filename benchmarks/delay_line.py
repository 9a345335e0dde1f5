"""A fixed delay on a network namespace's incoming packets, for kernels without netem.

    python delay_line.py --delay-ms 1.0 [--queue 0]     # run inside the namespace, as root

A kernel built without the netem qdisc (``CONFIG_NET_SCH_NETEM``) cannot add a fixed
latency to a link with ``tc``. This does it with the netfilter queue instead: an
``iptables -t mangle -A PREROUTING -i eth0 -j NFQUEUE`` rule (see :func:`rule`) hands
every packet the namespace receives to this process, which keeps only its id (the
payload stays in the kernel: copy mode "meta") and tells the kernel to let it go on
``delay_ms`` after it arrived. Packets are still carried, queued and acknowledged by the
kernel's own TCP/IP stack; only their release waits. Delaying what a host *receives*
gives every direction of every link the delay once (each packet is received by exactly
one host), so a round trip pays it twice, as a cable of that latency would; and
received packets belong to no local socket, so the held bytes do not count against the
sender's TCP small-queue budget (they would on the sending side).

Packets are released in arrival order (one delay for all: the due packets are always a
prefix of the queue), with one batch verdict per wake-up. The process asks for a
real-time priority so that a loaded machine does not stretch the delay; it prints
``ready`` once the queue is bound, and exits when stdin closes or on SIGTERM.

The netlink messages are those of ``linux/netfilter/nfnetlink_queue.h``; no library
(libnetfilter_queue, python bindings) is needed.
"""

from __future__ import annotations

import argparse
import collections
import os
import select
import signal
import socket
import struct
import sys
import time

__all__ = ["rule", "serve", "main"]

_NETLINK_NETFILTER = 12
_SOL_NETLINK = 270
_NETLINK_NO_ENOBUFS = 5
_NLMSG_ERROR = 2
_NLM_F_REQUEST, _NLM_F_ACK = 1, 4
_SUBSYS_QUEUE = 3
_MSG_PACKET, _MSG_CONFIG, _MSG_VERDICT_BATCH = 0, 2, 3
_CFG_CMD, _CFG_PARAMS, _CFG_QUEUE_MAXLEN, _CFG_MASK, _CFG_FLAGS = 1, 2, 3, 4, 5
_CMD_BIND = 1
_COPY_META = 1
# Whole GSO packets (no segmentation for our sake: we never look at the payload).
_F_GSO = 1 << 2
_PACKET_HDR, _VERDICT_HDR = 1, 2
_NF_ACCEPT = 1
_QUEUE_MAXLEN = 1 << 16


def rule(queue: int = 0, dev: str = "eth0") -> list[str]:
    """The iptables rule (arguments after ``iptables``) that sends ``dev``'s incoming
    packets to ``queue``; add it only once :func:`serve` prints ``ready`` (a rule on an
    unbound queue drops packets)."""
    return ["-t", "mangle", "-A", "PREROUTING", "-i", dev, "-j", "NFQUEUE", "--queue-num", str(queue)]


def _attr(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind) + payload + b"\0" * (-size % 4)


def _message(kind: int, queue: int, attrs: bytes, seq: int, flags: int) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body


def _config(sock: socket.socket, queue: int) -> None:
    attrs = (_attr(_CFG_CMD, struct.pack("!BxH", _CMD_BIND, socket.AF_INET))
             + _attr(_CFG_PARAMS, struct.pack("!IB", 0, _COPY_META))
             + _attr(_CFG_QUEUE_MAXLEN, struct.pack("!I", _QUEUE_MAXLEN))
             + _attr(_CFG_FLAGS, struct.pack("!I", _F_GSO))
             + _attr(_CFG_MASK, struct.pack("!I", _F_GSO)))
    sock.send(_message(_MSG_CONFIG, queue, attrs, 1, _NLM_F_REQUEST | _NLM_F_ACK))
    data = sock.recv(65536)
    kind = struct.unpack_from("=H", data, 4)[0]
    code = struct.unpack_from("=i", data, 16)[0] if kind == _NLMSG_ERROR else 0
    if code:
        raise OSError(-code, f"binding netfilter queue {queue}: {os.strerror(-code)}")


def _packet_ids(data: bytes) -> list[int]:
    """The ids of the queued packets in one read of the socket (several messages)."""
    ids, off = [], 0
    while off + 16 <= len(data):
        size, kind = struct.unpack_from("=IH", data, off)
        if size < 16:
            break
        if kind == (_SUBSYS_QUEUE << 8) | _MSG_PACKET:
            a = off + 20  # after nlmsghdr and nfgenmsg
            while a + 4 <= off + size:
                alen, atype = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                if atype & 0x7FFF == _PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, a + 4)[0])
                    break
                a += (alen + 3) & ~3
        off += (size + 3) & ~3
    return ids


def serve(delay_s: float, queue: int = 0) -> None:
    """Hold each packet of ``queue`` for ``delay_s`` from its arrival, in order; until
    stdin closes or SIGTERM."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE: bursts of metadata
    sock.setsockopt(_SOL_NETLINK, _NETLINK_NO_ENOBUFS, 1)
    sock.bind((0, 0))
    _config(sock, queue)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (OSError, AttributeError):
        pass  # ordinary priority: the delay may stretch on a loaded machine
    print("ready", flush=True)
    held: collections.deque[tuple[float, int]] = collections.deque()
    watch = [sock, sys.stdin]
    seq = 2
    while True:
        now = time.monotonic()
        wait = max(0.0, held[0][0] - now) if held else None
        readable, _, _ = select.select(watch, [], [], wait)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
            return
        if sock in readable:
            arrived = time.monotonic()
            while True:
                try:
                    data = sock.recv(1 << 16, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                held.extend((arrived + delay_s, pid) for pid in _packet_ids(data))
        now = time.monotonic()
        last = None
        while held and held[0][0] <= now:
            last = held.popleft()[1]
        if last is not None:
            verdict = _attr(_VERDICT_HDR, struct.pack("!II", _NF_ACCEPT, last))
            sock.send(_message(_MSG_VERDICT_BATCH, queue, verdict, seq, _NLM_F_REQUEST))
            seq += 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("--queue", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 < args.delay_ms < 10_000:
        p.error(f"--delay-ms must be in (0, 10000), got {args.delay_ms}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve(args.delay_ms / 1e3, args.queue)
    except OSError as exc:
        print(f"delay_line.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
