"""``ddpjob --host``: what working from a laptop costs. ``ddpjob --host cluster status RUN`` over a warm SSH connection
against ``ddpjob status RUN`` run on the login node itself (target: within 0.3 s), and the SSH connections that ten
commands in a row open (target: one).

The login node is a real OpenSSH server on loopback, the laptop a HOME and PATH of its own (tests/support/sshd.py):
the figures are ddpjob's and ssh's own costs (two Python processes instead of one, a multiplexed session), not a
network's round trips, which a real laptop adds once per command. The run is prepared once (``ddpjob prepare``, no
job); the two kinds alternate (ABBA), medians of ``--repeats``. Connections are sshd's "Accepted publickey" lines.

    .venv/bin/python bench/remote_status.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import sshd  # noqa: E402  (the test suite's sshd and laptop)


def timed(cmd: list[str], env: dict[str, str], cwd: Path) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[-4:])} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    server = sshd.start_server(tmp / "sshd")
    laptop = sshd.Laptop.make(tmp / "home", server)
    remote = tmp / "remote"
    remote.mkdir()
    laptop.host_file(laptop.cluster_entry(remote_dir=str(remote)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        prepared = subprocess.run([sys.executable, "-m", "jobs", "prepare", str(ROOT / "configs" / "digits.yaml"),
                                   "--no-cluster-check", "wandb.mode=disabled"], env=env, cwd=remote,
                                  capture_output=True, text=True, check=True)  # fmt: skip
        run = prepared.stdout.strip().splitlines()[-1]
        local_cmd = [sys.executable, "-m", "jobs", "status", run]
        remote_cmd = [sys.executable, "-m", "jobs", "--host", "cluster", "status", run]
        first = server.connections()
        cold = timed(remote_cmd, laptop.env, laptop.home)  # logs in, checks the version: the master starts
        for _ in range(9):
            timed(remote_cmd, laptop.env, laptop.home)
        connections = server.connections() - first
        local, warm = [], []
        for i in range(args.repeats):
            pair = [(local, local_cmd, env, remote), (warm, remote_cmd, laptop.env, laptop.home)]
            for times, cmd, e, cwd in pair if i % 2 == 0 else pair[::-1]:
                times.append(timed(cmd, e, cwd))
    finally:
        laptop.close()
        server.stop()
    lo, wa = statistics.median(local), statistics.median(warm)
    print("| case | login node | laptop (--host) | difference | target |")
    print("|---|---|---|---|---|")
    print(f"| `status RUN`, warm connection (median of {args.repeats}) | {lo:.3f} s | {wa:.3f} s | "
          f"+{wa - lo:.3f} s | within 0.3 s: {'met' if wa - lo <= 0.3 else 'NOT met'} |")  # fmt: skip
    print(f"| the first command (login + version check) | | {cold:.3f} s | | |")
    met = "met" if connections == 1 else "NOT met"
    print(f"| SSH connections opened by 10 commands in a row | | {connections} | | 1: {met} |")


if __name__ == "__main__":
    main()
