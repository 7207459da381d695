"""What a forwarded command sends and runs, without a connection: the arguments (the global options left out, sent
files renamed), the staging folder's layout, the remote snapshot's record of what was sent, and ``logs
--skip-lines`` (how ``logs -f`` follows again after a lost connection)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from ddp_core.config import load_config
from ddp_core.run.rundir import RunDir
from jobs.remote import forward
from jobs.remote.hosts import Host
from jobs.remote.ssh import Gateway
from jobs.remote.staging import Stage
from jobs.runs.logs import SkipLines
from jobs.submission import snapshot


def test_command_arguments():
    argv = ["--host", "c", "--remote-dir=/x", "submit", "a.yaml", "--host", "k=v"]
    assert forward.split_globals(argv) == (
        {"--host": "c", "--remote-dir": "/x"}, ["submit", "a.yaml", "--host", "k=v"]
    )  # fmt: skip
    assert forward.command_argv(["--host=c", "sweep", "s.yaml", "--", "--lr"]) == ["sweep", "s.yaml", "--", "--lr"]
    assert forward.command_argv(["status"]) == ["status"] and forward.split_globals(["--host", "c"]) == (
        {"--host": "c"},
        [],
    )
    swap = {"a.yaml": "/r/tree/a.yaml"}
    assert forward.rewrite(["submit", "a.yaml", "--cfg=a.yaml", "x=a.yaml", "--", "a.yaml"], swap) == [
        "submit", "/r/tree/a.yaml", "--cfg=/r/tree/a.yaml", "x=a.yaml", "--", "a.yaml"
    ]  # fmt: skip


def test_stage_layout_keeps_relative_paths(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "mypkg").mkdir(parents=True)
    (project / "mypkg" / "__init__.py").write_text("")
    (project / "mypkg" / "task.py").write_text("X = 1\n")
    (project / "configs").mkdir()
    (project / "configs" / "a.yaml").write_text("run: {name: a}\n")
    monkeypatch.chdir(project)
    stage = Stage(Gateway(Host("c", "c", "/remote/p", "ddpjob")))
    assert stage.remote.startswith("/remote/p/.ddpjob/incoming/")
    assert stage.add_file("configs/a.yaml") == f"{stage.remote}/tree/configs/a.yaml"
    code = snapshot.Plan(project / "mypkg", "package", [Path("__init__.py"), Path("task.py")], 6, ["mypkg"])
    assert stage.add_code(code) == f"{stage.remote}/tree"  # a package is imported from its parent folder
    outside = tmp_path / "elsewhere.yaml"
    outside.write_text("")
    assert stage.add_file(outside) == f"{stage.remote}/tree/_abs{outside}"
    files = sorted(str(p.relative_to(stage.local)) for p in stage.local.rglob("*") if p.is_file())
    assert files == ["tree/_abs" + str(outside), "tree/configs/a.yaml", "tree/mypkg/__init__.py", "tree/mypkg/task.py"]
    assert Stage(Gateway(Host("c", "c", "/remote/p", "ddpjob"))).remote != stage.remote  # never shared
    stage.discard()


def test_the_remote_snapshot_records_what_was_sent(tmp_path, monkeypatch):
    sent = tmp_path / "incoming" / "laptop-1"
    script = sent / "tree" / "proj" / "train.py"
    script.parent.mkdir(parents=True)
    script.write_text("print('hi')\n")
    record = {"from": "laptop", "code": {"source": "/home/me/proj", "kind": "directory", "git": {"commit": "abc"},
                                         "diff": "--- a\n+++ b\n"}}  # fmt: skip
    (sent / "sent.json").write_text(json.dumps(record))
    monkeypatch.setenv(snapshot.SENT_ENV, str(sent / "sent.json"))
    cfg = load_config(None, ["run.name=t", f"script.path={script}"])
    plan = snapshot.plan(cfg)
    assert plan is not None and plan.files == [Path("train.py")] and plan.git == {"commit": "abc"}
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    snapshot.take(plan, run)
    saved = json.loads((run.path / "code.json").read_text())
    assert saved["sent"] == {"from": "laptop", "source": "/home/me/proj", "kind": "directory"}
    assert saved["git"]["commit"] == "abc" and (run.path / "code.diff").read_text() == "--- a\n+++ b\n"


def test_skip_lines():
    out = io.StringIO()
    skip = SkipLines(out, 3)
    for piece in ("one\ntw", "o\n", "three\nfour", "\nfive\n"):
        skip.write(piece)
    assert out.getvalue() == "four\nfive\n"
