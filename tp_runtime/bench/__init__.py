"""The benchmarks: latency, throughput, messaging and serve (`tp-runtime bench ...`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def write_json(path: str, result: Any) -> None:
    """A benchmark's results as strict JSON: a figure that does not exist (a NaN: no decode step to time)
    is null, which every JSON parser reads."""

    def strict(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: strict(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [strict(item) for item in value]
        return value

    with open(Path(path).expanduser(), "w") as f:
        json.dump(strict(result), f, indent=2, allow_nan=False)
