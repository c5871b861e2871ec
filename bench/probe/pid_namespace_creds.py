#!/usr/bin/env python3
"""Issue 51, item 1: what the kernel tells each side of a Unix socket about its peer when
the two live in different PID namespaces — the facts a namespace-proof identity and the
freeing rule's liveness check can rest on.

A listener here (the host's PID namespace) and a client started under
`unshare -p -f --mount-proc` (a namespace of its own, as a container's), both connected
through a socket path; then the same with the roles swapped. Each side prints, as JSON:

- `peercred_pid`: `SO_PEERCRED`'s pid (the peer as our namespace names it; 0 if it cannot);
- `peerpidfd`: whether `SO_PEERPIDFD` (Linux 6.5+) gave a pidfd, and that pidfd's
  `/proc/self/fdinfo` lines `Pid` (the peer in our namespace: 0 if invisible, -1 once dead)
  and `NSpid` (its pid in each namespace from ours down);
- `pidfd_ino`: the pidfd's inode number (on pidfs, Linux 6.9+: one number per process,
  never reused while the system runs, the same whichever namespace asks);
- `self_ino`: the inode of a pidfd this side opens on itself (`pidfd_open(getpid())`),
  to compare with what the other side sees of it;
- after the peer exits: whether the pidfd polls readable (its death seen without a pid)
  and `Pid` reads -1.

usage: sudo python3 bench/probe/pid_namespace_creds.py     (root: unshare -p)
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import time

SO_PEERPIDFD = 77


def fdinfo(fd: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Pid", "NSpid"):
                out[k] = v.strip()
    return out


def describe(sock: socket.socket, role: str) -> tuple[dict, int | None]:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    facts: dict = {"role": role, "my_pid": os.getpid(), "peercred_pid": pid, "peercred_uid": uid}
    pidfd = None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4)
        pidfd = struct.unpack("i", raw)[0]
        facts["peerpidfd"] = True
        facts["peerpidfd_fdinfo"] = fdinfo(pidfd)
        facts["pidfd_ino"] = os.fstat(pidfd).st_ino
    except OSError as e:
        facts["peerpidfd"] = f"refused: {e}"
    me = os.pidfd_open(os.getpid())
    facts["self_ino"] = os.fstat(me).st_ino
    os.close(me)
    return facts, pidfd


def after_exit(pidfd: int | None, facts: dict) -> None:
    if pidfd is None:
        return
    readable, _, _ = select.select([pidfd], [], [], 5.0)
    facts["pidfd_readable_after_peer_exit"] = bool(readable)
    facts["fdinfo_after_exit"] = fdinfo(pidfd)


def serve(path: str, role: str) -> None:
    """Accepts one client, trades facts, waits for it to exit, prints."""
    l = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    l.bind(path)
    l.listen(1)
    print("ready", flush=True)
    c, _ = l.accept()
    facts, pidfd = describe(c, role)
    c.sendall((json.dumps(facts) + "\n").encode())
    theirs = json.loads(c.makefile().readline())
    facts["peer_says_self_ino"] = theirs["self_ino"]
    c.recv(1)  # the client's end of stream: it is exiting
    time.sleep(0.2)
    after_exit(pidfd, facts)
    print(json.dumps(facts), flush=True)


def connect(path: str, role: str) -> None:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for _ in range(100):
        try:
            c.connect(path)
            break
        except OSError:
            time.sleep(0.05)
    facts, _ = describe(c, role)
    c.sendall((json.dumps(facts) + "\n").encode())
    theirs = json.loads(c.makefile().readline())
    facts["peer_says_self_ino"] = theirs["self_ino"]
    print(json.dumps(facts), flush=True)
    c.close()


def main() -> None:
    if len(sys.argv) > 1:
        {"serve": serve, "connect": connect}[sys.argv[1]](sys.argv[2], sys.argv[3])
        return
    me = os.path.abspath(__file__)
    print(json.dumps({"kernel": os.uname().release}))
    with tempfile.TemporaryDirectory() as d:
        for case, server_ns, client_ns in [
            ("client in a PID namespace of its own", False, True),
            ("server in a PID namespace of its own", True, False),
        ]:
            path = os.path.join(d, f"s{int(server_ns)}")
            wrap = lambda inner: (["unshare", "-p", "-f", "--mount-proc"] if inner else [])
            server = subprocess.Popen(
                wrap(server_ns) + [sys.executable, me, "serve", path, "server"],
                stdout=subprocess.PIPE, text=True)
            assert server.stdout.readline().strip() == "ready"
            client = subprocess.run(
                wrap(client_ns) + [sys.executable, me, "connect", path, "client"],
                capture_output=True, text=True, timeout=30)
            print(json.dumps({"case": case}))
            print(client.stdout.strip() or client.stderr.strip())
            print(server.stdout.read().strip())
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
