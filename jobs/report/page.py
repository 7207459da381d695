"""``report.html``: one self-contained page (plotly.js inline, no CDN, no external file) that answers what a sweep
was for: the best trial and the commands that rerun or resume it, the metric against each swept key, parallel
coordinates and importances, the top trials, curves over steps, and every trial with its state; a single run's page
also says where its time went (its goodput, ``jobs.runs.goodput``).
"""

from __future__ import annotations

import html
from typing import Any, Optional

from ddp_core.run.rundir import RunDir
from jobs.report import figures
from jobs.report.table import fmt, label, metric_keys, rerun_command, resume_command, value_text
from jobs.report.trials import NO_METRICS, Sweep, Trial
from jobs.runs import goodput, notes, throughput

TOP_K = 10
CSS = """body{font:14px system-ui,sans-serif;margin:1.5em;color:#222;max-width:1400px}
h2{margin-top:1.6em;border-bottom:1px solid #ddd}.chart{border:1px solid #ddd;margin:.6em 0;background:#fff}
table{border-collapse:collapse;margin-top:.6em}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
td:first-child,th:first-child,td.text{text-align:left}tr.best{background:#fff4c2;font-weight:600}.note{color:#666}
code{font-size:12px;background:#f5f5f5;padding:1px 4px;word-break:break-all}.state-fail{color:#d62728}
.state-pruned{color:#ff7f0e}.state-running,.state-pending{color:#7f7f7f}details{margin-top:1em}"""


def chart(name: str, figure: Any, note: str = "") -> str:
    """A chart's div and the script that draws it; data-chart names it for readers (and the browser test)."""
    div = f"chart-{name}"
    config = '{"displaylogo": false, "responsive": true}'
    return (
        f'<section class="chart" data-chart="{html.escape(name)}">{note}<div id="{div}"></div>'
        f"<script>(function(){{var f={figures.to_json(figure)};"
        f'Plotly.newPlot("{div}", f.data, f.layout, {config});}})();</script></section>'
    )


def _summary(sweep: Sweep, best: Optional[Trial]) -> str:
    esc = html.escape
    counts = ", ".join(f"{n} {s}" for s, n in sweep.counts().items() if n)
    how = "min" if sweep.minimise else "max"
    which = "best value per checkpoint.monitor" if sweep.monitored else "final value"
    lines = [f"<p>{len(sweep.trials)} {'run' if sweep.kind == 'run' else 'trials'}: {counts}.</p>"]
    if best is None:
        lines.append(f"<p>no trial has a value for {esc(sweep.metric)} yet</p>")
        return "\n".join(lines)
    lines.append(
        f'<p class="best-summary">best by {esc(sweep.metric)} ({how}, {which}): <b>{esc(best.name)}</b> '
        f"= {fmt(best.value)}{' — ' + esc(label(best, sweep.keys)) if sweep.keys else ''}</p>"
    )
    if sweep.kind != "run":
        lines.append(f"<p>rerun it as a single run: <code>{esc(rerun_command(sweep, best))}</code><br>")
        lines.append(f"resume it: <code>{esc(resume_command(best))}</code></p>")
    return "\n".join(lines)


def _table(sweep: Sweep, trials: list[Trial], best: Optional[Trial], commands: bool) -> str:
    esc = html.escape
    metrics = [k for k in metric_keys(sweep) if k != sweep.metric]
    head = ["trial", *sweep.keys, sweep.metric, "state", "last step", *metrics, *(["rerun"] if commands else [])]
    rows = []
    for t in trials:
        step = t.last_step()
        cells = [esc(t.name) + (' <span class="best-marker">★ best</span>' if t is best else "")]
        cells += [esc(value_text(t.params[k])) if k in t.params else "—" for k in sweep.keys]
        cells += [fmt(t.value), f'<span class="state-{t.state}">{t.state}</span>']
        cells += [NO_METRICS if step is None else str(step), *(fmt(t.final(k)) for k in metrics)]
        if commands:
            # Folded: a full command per row would make every row a paragraph; the best one's is on top unfolded.
            command = f'<code class="rerun">{esc(rerun_command(sweep, t))}</code>'
            cells.append(f"<details><summary>command</summary>{command}</details>")
        attrs = ' class="best"' if t is best else ""
        rows.append(f"<tr{attrs}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    header = "".join(f"<th>{esc(h)}</th>" for h in head)
    return f"<table><thead><tr>{header}</tr></thead><tbody>\n" + "\n".join(rows) + "\n</tbody></table>"


def _hyperparameter_charts(sweep: Sweep) -> list[str]:
    from jobs.report import study as studies

    if not sweep.keys:
        return []
    parts = ["<h2>Hyperparameters against the outcome</h2>"]
    missing = figures.trials_without_value(sweep)
    note = (
        f'<p class="note">{len(missing)} trial(s) without a value of {html.escape(sweep.metric)} are not plotted '
        f"(listed in the table below with their state).</p>"
        if missing
        else ""
    )
    parts.append(chart("slice", figures.slice_figure(sweep), note))
    study = studies.build(sweep)
    drawn = figures.optuna_figures(sweep, study)
    if "parallel" in drawn:
        parts.append(chart("parallel", drawn["parallel"]))
    shares = studies.importances(sweep)
    if shares:
        parts.append(chart("importance", figures.importance_figure(shares, sweep.metric)))
    else:
        parts.append(
            f'<p class="note">parameter importance needs {studies.MIN_IMPORTANCE_TRIALS} trials with a value and at '
            f"least 2 swept keys (this sweep: {len(study.trials)} and {len(sweep.keys)}).</p>"
        )
    if "history" in drawn:
        parts.append(chart("history", drawn["history"]))
    return parts


def _goodput(sweep: Sweep) -> str:
    """One run's goodput (``jobs.runs.goodput``): each term's time and share, and what it counts; empty for a sweep
    or a run that has not started."""
    measured = goodput.of_run(RunDir(sweep.trials[0].path)) if sweep.kind == "run" and sweep.trials else None
    if measured is None:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(label)}</td><td>{goodput.duration(measured.seconds[term])}</td>"
        f"<td>{100 * measured.share(term):.1f}%</td><td>{html.escape(measured.counts(term))}</td>"
        f'<td class="text">{html.escape(what)}</td></tr>'
        for term, label, what in goodput.TERMS
    )
    head = "".join(f"<th>{h}</th>" for h in ("", "time", "share", "count", "what it is"))
    return (
        f'<h2>Goodput</h2><p class="goodput">{html.escape(measured.line())}</p>'
        f'<table class="goodput"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'
    )


def _throughput(sweep: Sweep) -> str:
    """One run's last throughput line and its GPU energy (``jobs.runs.throughput``); empty for a sweep."""
    if sweep.kind != "run" or not sweep.trials:
        return ""
    run = RunDir(sweep.trials[0].path)
    line = throughput.describe(run.metrics(), None)
    return f'<h2>Throughput</h2><p class="throughput">{html.escape(line)}</p>' if line else ""


def _memory(sweep: Sweep) -> str:
    """What a run did about memory (``jobs.runs.notes.memory_note``): under ``data.batch_size=auto`` the micro-batch
    its probe chose and each halving, under ``train.invariant`` the step it began recomputing activations; empty
    otherwise."""
    if sweep.kind != "run" or not sweep.trials:
        return ""
    run = RunDir(sweep.trials[0].path)
    note = notes.memory_note(run.path.name, run.events())
    return f'<h2>Memory</h2><p class="memory">{html.escape(note)}</p>' if note else ""


def render(sweep: Sweep, title: str, search_lines: list[str]) -> str:
    from plotly.offline import get_plotlyjs  # plotly.js, inlined: the page works offline

    esc = html.escape
    best = sweep.best
    parts = [f"<h1>{esc(title)}</h1>", _summary(sweep, best)]
    if search_lines:
        parts.append("<p>" + "<br>".join(esc(line) for line in search_lines) + "</p>")
    parts += _hyperparameter_charts(sweep)
    ranked = sweep.ranked()
    if sweep.keys:
        parts += [f"<h2>Top {min(TOP_K, len(ranked))} trials</h2>", _table(sweep, ranked[:TOP_K], best, True)]
    keys = figures.curve_keys(sweep, metric_keys(sweep))
    parts.append("<h2>Curves over steps</h2>")
    if keys:
        parts += [chart(f"curve-{k}", figures.curve_figure(sweep, k)) for k in keys]
    else:
        parts.append(
            f'<p class="note">{NO_METRICS if not metric_keys(sweep) else "no metric has more than one point"}</p>'
        )
    every = _table(sweep, ranked, best, False)
    if sweep.keys:
        every = f"<details><summary>all {len(ranked)} trials</summary>{every}</details>"
    parts += [
        "<h2>Every trial</h2>" if sweep.kind != "run" else "",
        every,
        _throughput(sweep),
        _memory(sweep),
        _goodput(sweep),
    ]
    body = "\n".join(p for p in parts if p)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title><style>{CSS}</style>
<script>{get_plotlyjs()}</script></head>
<body>
{body}
</body></html>
"""
