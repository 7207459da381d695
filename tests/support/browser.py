"""Headless Chromium for the report's tests: open a page, let its scripts run, and return the DOM they left, the
JavaScript errors they raised and a screenshot.

Errors are caught from inside the page: a copy of it gets a first script that records every ``error`` event and
``console.error`` call on the <html> element, which ``--dump-dom`` then shows. The screenshot is a second run of the
same copy (Chromium takes either a DOM dump or a screenshot per run).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CATCH_ERRORS = """<script>(function(){var root=document.documentElement;
function note(m){root.setAttribute('data-js-errors',(root.getAttribute('data-js-errors')||'')+String(m)+' | ');}
window.addEventListener('error',function(e){note(e.message||e);});
window.addEventListener('unhandledrejection',function(e){note(e.reason);});
var log=console.error;
console.error=function(){note(Array.prototype.join.call(arguments,' '));log.apply(console,arguments);};
})();</script>"""


def chromium() -> Optional[str]:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Rendered:
    dom: str
    errors: list[str]
    screenshot: Path


def _run(binary: str, page: Path, profile: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    command = [
        binary,
        "--headless",
        "--no-sandbox",  # tests run as root in CI's containers
        "--disable-gpu",
        "--use-angle=swiftshader",  # WebGL (parallel coordinates) on the CPU
        "--enable-unsafe-swiftshader",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=20000",  # run the page's scripts and timers before dumping
        *flags,
        page.as_uri(),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)


def render(page: Path, out_dir: Path, width: int = 1400, height: int = 4000) -> Rendered:
    binary = chromium()
    assert binary is not None, "chromium is not installed (scripts/slurm-local installs it with the cluster's packages)"
    out_dir.mkdir(parents=True, exist_ok=True)
    copy = out_dir / f"checked-{page.name}"
    text = page.read_text(encoding="utf-8")
    copy.write_text(text.replace("<head>", "<head>" + CATCH_ERRORS, 1), encoding="utf-8")
    dumped = _run(binary, copy, out_dir / "profile", "--dump-dom")
    assert dumped.returncode == 0 and "<html" in dumped.stdout, dumped.stderr[-2000:]
    found = re.search(r'data-js-errors="([^"]*)"', dumped.stdout)
    errors = [e.strip() for e in found.group(1).split(" | ") if e.strip()] if found else []
    shot = out_dir / f"{page.stem}.png"
    taken = _run(binary, copy, out_dir / "profile", f"--screenshot={shot}", f"--window-size={width},{height}")
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    return Rendered(dumped.stdout, errors, shot)


def chart_sections(dom: str) -> dict[str, str]:
    """data-chart name -> the HTML Plotly drew into that chart's section."""
    parts = re.split(r'<section class="chart" data-chart="([^"]+)">', dom)
    return {name: body.split("</section>", 1)[0] for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def drawn_marks(section: str) -> int:
    """How many data marks Plotly drew into a chart's SVG: markers and bars (class point), lines (js-line); none
    when the chart is blank (a script that failed, data that did not reach Plotly)."""
    if 'class="main-svg"' not in section:
        return 0
    return len(re.findall(r'class="(?:point|js-line)"', section))
