"""A capture at the switch of the cross-host network (run by ``test_crosshost.py``).

``python crosshost_capture.py '<json params>'`` inside the switch's namespace
(``Network.switch_host()``), with ``markers``: strings to look for.  An
``AF_PACKET`` socket sees every frame that enters the switch from any host
(each frame once, on the port it came in by); the TCP payloads are searched
for the markers, also across the boundary of two segments of one flow.

Protocol with the test (JSON lines on stdout, lines on stdin):

1. ``{"event": "capturing"}`` once the socket is open;
2. it captures until a line arrives on stdin;
3. ``{"event": "result", ...}``: frames seen, TCP payload bytes (in total and
   between each pair of hosts), and how often each marker was seen.
"""

from __future__ import annotations

import json
import select
import socket
import struct
import sys
from collections import defaultdict

from support import stackdump

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SO_RCVBUFFORCE = 33


def main() -> None:
    params = json.loads(sys.argv[1])
    markers = [m.encode() for m in params["markers"]]
    keep = max(len(m) for m in markers) - 1
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    print(json.dumps({"event": "capturing"}), flush=True)

    frames = 0
    payload_bytes = 0
    between: dict = defaultdict(int)
    found = dict.fromkeys(params["markers"], 0)
    tails: dict = {}  # flow -> the last bytes of its previous segment

    def handle(frame: bytes) -> None:
        nonlocal payload_bytes
        if len(frame) < 34 or frame[12:14] != b"\x08\x00":  # IPv4 only
            return
        ip = frame[14:]
        ihl = (ip[0] & 0x0F) * 4
        total = struct.unpack("!H", ip[2:4])[0] or len(ip)  # 0 with TSO
        if ip[9] != 6 or len(ip) < ihl + 20:  # TCP only
            return
        src, dst = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
        tcp = ip[ihl : max(total, ihl + 20)]
        sport, dport = struct.unpack("!HH", tcp[:4])
        data = tcp[(tcp[12] >> 4) * 4 :]
        if not data:
            return
        payload_bytes += len(data)
        between[f"{src}->{dst}"] += len(data)
        flow = (src, sport, dst, dport)
        window = tails.get(flow, b"") + data
        for raw, name in zip(markers, params["markers"], strict=True):
            found[name] += window.count(raw)
        tails[flow] = data[-keep:] if keep else b""

    while True:
        ready, _, _ = select.select([sock, sys.stdin], [], [], 1.0)
        if sys.stdin in ready:
            sys.stdin.readline()
            break
        if sock in ready:
            while True:
                try:
                    frame, addr = sock.recvfrom(1 << 18, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING:
                    continue  # the same frame, leaving by another port
                frames += 1
                handle(frame)
    # What arrived before the stop line.
    while True:
        try:
            frame, addr = sock.recvfrom(1 << 18, socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        if addr[2] != PACKET_OUTGOING:
            frames += 1
            handle(frame)
    print(
        json.dumps(
            {
                "event": "result",
                "frames": frames,
                "payload_bytes": payload_bytes,
                "between": dict(between),
                "found": found,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    stackdump.install()  # where it hangs, if a test gives up on it
    main()
