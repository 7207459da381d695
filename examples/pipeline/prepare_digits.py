"""The digits pipeline's prepare step (configs/pipelines/digits.yaml): checks that scikit-learn's digits load, as
the train step will load them, and writes their summary into the step's run directory (``DDPJOB_RUN_DIR``). A real
pipeline would download, convert or shard its data here."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sklearn.datasets import load_digits


def main() -> None:
    images, labels = load_digits(return_X_y=True)
    if len(images) != len(labels) or images.shape[1] != 64:
        raise SystemExit(f"unexpected digits data: {images.shape} images, {labels.shape} labels")
    summary = {"samples": len(images), "features": images.shape[1], "classes": len(set(labels.tolist()))}
    out = Path(os.environ.get("DDPJOB_RUN_DIR", ".")) / "data_summary.json"
    out.write_text(json.dumps(summary) + "\n")
    print(f"digits: {summary} -> {out}")


if __name__ == "__main__":
    main()
