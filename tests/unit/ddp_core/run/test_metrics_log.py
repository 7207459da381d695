"""The run's metrics log: each line readable once written (``ddpjob status`` reads it while the job runs), a resumed
attempt's rewind, and the file closed at the end of an attempt."""

from __future__ import annotations

import json

from ddp_core.run.reporting import MetricsLog


def steps_in(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_lines_are_readable_as_written_and_a_resumed_attempt_drops_the_lines_after_its_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = MetricsLog(path, 0)
    for step in (25, 50, 75):
        first.write(step, "train", {"loss": 1.0 / step})
        assert steps_in(path)[-1] == step  # on disk before the attempt ends (the writer keeps its file open)
    first.sync()
    # The attempt dies without closing; the next resumes from step 50's checkpoint.
    second = MetricsLog(path, 50)
    assert second.previous_last_step == 75 and steps_in(path) == [25, 50]
    second.write(75, "train", {"loss": 0.5})
    second.close()
    second.close()  # idempotent
    second.write(100, "eval", {"loss": 0.25})  # a write after close (a script's log after finish) opens it again
    second.close()
    assert steps_in(path) == [25, 50, 75, 100]
    assert json.loads(path.read_text().splitlines()[-1])["split"] == "eval"
