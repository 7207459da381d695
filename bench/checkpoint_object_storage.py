"""Full checkpoint saves to object storage (``checkpoint.dir`` = ``s3://...``) against a local folder (what
``RUN/checkpoints`` is), synchronous and asynchronous, for a ~100M-parameter model with its AdamW state.

The S3 server is moto's server mode on loopback, started here (``python -m moto.server``, from the dev extra): an
S3 endpoint over HTTP as s3fs sees AWS, minus the network. Its own process stores the objects in memory; it shares
this machine's CPUs with the saving process, so the upload figures are a floor for a real store only in network
terms.

- sync: ``FullWriter.save`` without ``async_save``: training blocks for the whole write (local: serialise, fsync,
  rename; S3: serialise and upload in 64 MiB parts, then the manifest object);
- async: ``FullWriter.save`` with ``async_save`` and the optimizer, then a training step: "blocks" is the time
  training stood still, in the save and in the optimizer step's wait for the copy (as ``bench/checkpoint_save.py``
  times it); "done" is the save's start to its manifest, in the background.

The four (local sync, local async, S3 sync, S3 async) run alternated, ``--repeats`` rounds after one untimed warm-up
round; every figure is a median. The target: an async save to S3 blocks training no longer than one to the local
folder (within 1.2x): the upload is the background thread's, the copy to host memory the same.

    OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint_object_storage.py [--params 100e6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmarks, also when run from elsewhere
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this checkout's ddp_core

import torch
from checkpoint_save import Trained, big_model

from ddp_core.checkpoint import store as checkpoint
from ddp_core.checkpoint.full import FullWriter

TARGET = 1.2  # async blocked to S3 / async blocked to the local folder


class Moto:
    """moto's S3 server on a free loopback port, with the environment s3fs reads set in this process."""

    def __enter__(self) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("moto's server did not start (pip install 'moto[server]')") from None
                time.sleep(0.1)
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        )  # fmt: skip
        import s3fs

        bucket = f"bench-{secrets.token_hex(4)}"
        s3fs.S3FileSystem().mkdir(bucket)
        return f"s3://{bucket}"

    def __exit__(self, *_: object) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _rounds(repeats: int) -> Iterator[tuple[int, list[str]]]:
    cases = ["local sync", "local async", "s3 sync", "s3 async"]
    for step in range(repeats + 1):  # round 0 warms up (page cache, allocator, staging buffers, connections)
        yield step, cases[step % 4 :] + cases[: step % 4]


def measure(trained: Trained, local: Path, url: str, repeats: int) -> dict[str, Any]:
    state = trained.state
    writers = {
        "local sync": FullWriter(local / "sync", keep_last=1, async_save=False),
        "s3 sync": FullWriter(f"{url}/sync", keep_last=1, async_save=False),
        "local async": FullWriter(local / "async", keep_last=1, async_save=True, optimizer=trained.optimizer),
        "s3 async": FullWriter(f"{url}/async", keep_last=1, async_save=True, optimizer=trained.optimizer),
    }
    trained.watch()
    times: dict[str, list[float]] = {f"{case} {what}": [] for case in writers for what in ("blocked", "done")}
    for step, order in _rounds(repeats):
        for case in order:
            writer = writers[case]
            blocked = writer.save(step + 1, state)
            if writer.async_save:
                trained.step()  # its optimizer step waits for the copy of what it changes (fence_s)
                blocked += writer.fence_s
            writer.wait()
            times[f"{case} blocked"].append(blocked)
            times[f"{case} done"].append(writer.last_write_s or blocked)
            os.sync()
        if step == 0:
            for values in times.values():
                values.clear()
    for writer in writers.values():
        writer.close()
    info = checkpoint.find_latest(f"{url}/sync")
    assert info is not None
    median = {key: statistics.median(values) for key, values in times.items()}
    return {"file_mb": round(info.size / 1e6, 1), "repeats": repeats} | median


def rows(params: float = 100e6, repeats: int = 3, directory: Optional[Path] = None) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    trained = Trained(big_model(params), "cpu")
    n = sum(p.numel() for p in trained.model.parameters())
    with tempfile.TemporaryDirectory(dir=directory or "/var/tmp") as tmp, Moto() as url:
        row = measure(trained, Path(tmp), url, repeats)
    return [{"model": f"{n / 1e6:.0f}M params"} | row]


def print_table(table: list[dict[str, Any]]) -> None:
    print("full checkpoint save, AdamW state included: local folder vs S3 (moto on loopback); medians")
    for r in table:
        print(f"{r['model']} ({r['file_mb']:.0f} MB), {r['repeats']} rounds")
        print(f"{'':>8} | {'sync (blocks)':>13} | {'async blocks':>12} | {'async done':>10}")
        for where in ("local", "s3"):
            print(f"{where:>8} | {r[f'{where} sync blocked']:11.3f} s | {r[f'{where} async blocked']:10.3f} s | "
                  f"{r[f'{where} async done']:8.3f} s")  # fmt: skip
        ratio = r["s3 async blocked"] / r["local async blocked"]
        print(f"async blocks, S3 / local: {ratio:.2f}x (target <= {TARGET:.1f}x)")
        print(f"sync, S3 / local: {r['s3 sync blocked'] / r['local sync blocked']:.2f}x")


def summary(quick: bool = False) -> list[dict[str, Any]]:
    out = []
    for r in rows(repeats=2 if quick else 3):
        ratio = r["s3 async blocked"] / r["local async blocked"]
        out += [{
            "case": f"full checkpoint to S3 (moto), {r['model']}: async save, training blocked vs local folder",
            "baseline": f"{r['local async blocked']:.3f} s", "ddpjob": f"{r['s3 async blocked']:.3f} s",
            "ratio": ratio, "target": f"<= {TARGET:.2f}x", "met": ratio <= TARGET,
        }, {
            "case": f"full checkpoint to S3 (moto), {r['model']}: sync save vs local folder",
            "baseline": f"{r['local sync blocked']:.3f} s", "ddpjob": f"{r['s3 sync blocked']:.3f} s",
            "ratio": r["s3 sync blocked"] / r["local sync blocked"], "target": "", "met": None,
        }]  # fmt: skip
    return out


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--dir", type=Path, help="the local folder's parent (default: /var/tmp)")
    args = parser.parse_args(argv)
    table = rows(args.params, args.repeats, args.dir)
    print_table(table)
    return table


if __name__ == "__main__":
    main()
