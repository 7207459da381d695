"""Faults injected into the local cluster from outside a job, the same call as root or as a plain user (issue 54).

A killed or frozen node and a stopped slurmdbd are ``scripts/slurm-local`` subcommands, which need root: they signal
a node's slurmd and every process on it, whoever owns them. The user pass runs pytest itself as ``ddpjob-alice``
(``tests.support.as_user``), so a test calls ``slurm_local(...)``: as root it runs the script directly; as her it
asks the broker, a small root process that ``as_user`` forks before it drops to her. The broker serves only
``INJECTIONS`` (a node name of ``NODES``, nothing free-form, no shell) on a Unix socket only she can reach: 0600 and
owned by her, in a folder of hers (0700), and each connection's ``SO_PEERCRED`` uid checked against hers. It ends
with the pytest it was forked for. What she may do herself (SIGKILL or SIGSTOP of her own ranks, ``scancel`` or
``scontrol requeue`` of her own job) never goes through it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from tests.support.helpers import ROOT

BROKER_ENV = "DDPJOB_FAULT_BROKER"  # the socket's path, in the user's environment (tests.support.as_user)
NODES = ("n1", "n2", "n3")
# Each allowed request and how many node names it takes: scripts/slurm-local's subcommands, and resume-node, the
# cluster guard's repair of a node Slurm drained or marked down (tests/support/cluster_guard.py: heal), which as her
# Slurm refuses ("slurm_update error: Invalid user id") and which every later test of her pass would otherwise pay for.
INJECTIONS = {"kill-node": 1, "freeze-node": 1, "start-node": 1, "stop-accounting": 0, "start-accounting": 0,
              "resume-node": 1}  # fmt: skip
TIMEOUT_S = 150  # start-node waits up to 60 s for the node, after the node's slurmd has started
MAX_REQUEST = 256


def command(args: Sequence[str]) -> list[str]:
    """The command line of an allowed request (``INJECTIONS``); ``ValueError`` for anything else (the one check, on
    either side of the socket: a test that passes as root asks nothing the broker would refuse)."""
    args = list(args)
    if not args or args[0] not in INJECTIONS or len(args) != 1 + INJECTIONS[args[0]]:
        raise ValueError(f"not a fault injection: {args!r} (allowed: {', '.join(INJECTIONS)})")
    if any(arg not in NODES for arg in args[1:]):
        raise ValueError(f"not a node of the local cluster: {args[1:]!r} (allowed: {', '.join(NODES)})")
    if args[0] == "resume-node":
        return ["scontrol", "update", f"NodeName={args[1]}", "State=RESUME"]
    return [str(ROOT / "scripts" / "slurm-local"), *args]


def slurm_local(*args: str) -> subprocess.CompletedProcess[str]:
    """``scripts/slurm-local ARGS`` (one of ``INJECTIONS``): run here as root, through the broker as a plain user.
    Returns its exit code and output; the caller decides what a failure means."""
    return _as_root(args)


def resume_node(node: str) -> subprocess.CompletedProcess[str]:
    """``scontrol update NodeName=NODE State=RESUME``, as root (through the broker as a plain user)."""
    return _as_root(["resume-node", node])


def _as_root(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    cmd = command(args)
    if os.geteuid() == 0:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    path = os.environ.get(BROKER_ENV)
    if not path:
        raise RuntimeError(f"{args[0]} needs root: as a plain user run pytest through tests.support.as_user (its "
                           f"fault broker, {BROKER_ENV})")  # fmt: skip
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(TIMEOUT_S + 30)
        conn.connect(path)
        conn.sendall(json.dumps(list(args)).encode() + b"\n")
        reply = json.loads(_read_all(conn))
    return subprocess.CompletedProcess(cmd, reply["returncode"], reply["stdout"], reply["stderr"])


def _read_all(conn: socket.socket) -> bytes:
    chunks = []
    while chunk := conn.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def start_broker(uid: int, gid: int) -> tuple[Path, int]:
    """Fork the broker (root) for the user ``uid``; returns its socket's path and its pid. The folder is made by root
    (0700) with the socket bound in it before either is handed to her, so nothing of hers can stand in the way of the
    bind;
    the broker removes both when the process that started it has gone (its pytest, after the exec)."""
    folder = Path(tempfile.mkdtemp(prefix="ddpjob-faults-", dir="/tmp"))
    path = folder / "broker.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o600)
    os.chown(path, uid, gid)
    os.chown(folder, uid, gid)
    server.listen(4)
    parent = os.getpid()
    if (pid := os.fork()) == 0:
        code = 0
        try:
            serve(server, uid, parent)
        except BaseException as err:  # the child must never return into the caller's code
            print(f"fault broker: {err!r}", file=sys.stderr)
            code = 1
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            os._exit(code)
    server.close()
    return path, pid


def serve(server: socket.socket, uid: int, parent: int) -> None:
    """Answer one request per connection, one at a time, until ``parent`` is gone."""
    server.settimeout(1.0)
    while os.getppid() == parent:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(TIMEOUT_S + 30)
            conn.sendall(json.dumps(answer(conn, uid)).encode())


def peer_uid(conn: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid


def answer(conn: socket.socket, uid: int) -> dict[str, object]:
    """The reply to one connection: the injection's exit code and output, or a refusal (exit 2) saying why."""
    request = b""  # read first: a socket closed with a request unread resets the connection, reply and all
    while not request.endswith(b"\n") and len(request) <= MAX_REQUEST:
        if not (chunk := conn.recv(MAX_REQUEST)):
            break
        request += chunk
    if (peer := peer_uid(conn)) != uid:
        return refusal(f"uid {peer} may not ask this broker (it serves uid {uid})")
    try:
        args = json.loads(request)
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"not a list of words: {request[:MAX_REQUEST]!r}")
        cmd = command(args)
    except ValueError as err:  # json's errors are ValueErrors too
        return refusal(str(err))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return refusal(f"{' '.join(args)} did not end within {TIMEOUT_S} s")
    return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


def refusal(why: str) -> dict[str, object]:
    return {"returncode": 2, "stdout": "", "stderr": f"fault broker: {why}\n"}
