"""What a benchmark ran on: every benchmark states its hardware next to its numbers."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (else what ``platform`` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "?"


def load_avg() -> float:
    """1-minute load average (NaN where the OS has none): benchmarks on a shared host say how busy it was."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
