"""A real S3-compatible server for the tests: moto's server mode (``moto_server``) on a free loopback port, in a
process of its own. s3fs talks to it through aiobotocore over HTTP, as to AWS; in-process mocks would not intercept
that. Credentials and the endpoint reach s3fs the standard way, through the environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``), which a job submitted from the test inherits too.

Use the ``s3`` fixture (import it into the test module): a bucket of its own per test, the server shared by the
session."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from ddp_core.cluster.rendezvous import free_port
from tests.support.helpers import stop_server

# Random per session (so not in any source file either, the run's code snapshot included): a test looks for them
# in everything a run writes, where they must appear nowhere.
ACCESS_KEY = "AKIA" + secrets.token_hex(8).upper()
SECRET_KEY = secrets.token_urlsafe(30)


@dataclass
class S3:
    endpoint: str
    bucket: str

    def url(self, prefix: str = "ckpt") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
        }


def start_server(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m moto.server`` on a free loopback port; returns it once it answers HTTP."""
    for _ in range(5):  # the port may be taken between choosing it and the server's bind: another one then
        port = free_port()
        out = open(log, "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        )
        out.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return proc, f"http://127.0.0.1:{port}"
            except OSError:
                time.sleep(0.1)
        proc.kill()
        proc.wait()
    raise RuntimeError(f"moto_server did not start: see {log}")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, endpoint = start_server(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield endpoint
    finally:
        stop_server(proc)


@pytest.fixture
def s3(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    """A fresh bucket on the session's server, with the environment that reaches it set for this test."""
    import s3fs

    server = S3(s3_server, f"ddpjob-{secrets.token_hex(4)}")
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    # fsspec keeps filesystem instances per process, keyed by their arguments, not by the environment they read.
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir(server.bucket)
    yield server
    s3fs.S3FileSystem.clear_instance_cache()


def killed_while_uploading(bucket: str, url: str, script: str, key_end: str, timeout_s: float = 60) -> None:
    """Run ``script`` (``sys.argv[1]``: ``url``) until it prints ``saved``, then SIGKILL it once a multipart upload of
    an object whose key ends with ``key_end`` is in flight on the server (begun, not completed): a writer that dies
    mid-upload, as a preempted node's would."""
    import boto3

    def uploading() -> bool:
        uploads = boto3.client("s3").list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        return any(u["Key"].endswith(key_end) for u in uploads)

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", script, url], stdout=subprocess.PIPE, text=True, cwd=root,
                            env=os.environ | {"OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "saved\n"
        deadline = time.monotonic() + timeout_s
        while not uploading() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert uploading(), f"no upload of *{key_end} began within {timeout_s:g} s"
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -9
