"""The machine a benchmark ran on, for its header line: cores, CPU name, AMX or not
(bf16 matrix units change CPU figures several-fold, and machines differ between runs)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def has_amx() -> bool:
    return "amx_bf16" in Path("/proc/cpuinfo").read_text()


def machine() -> str:
    """``2 cores of AMD EPYC ... (no AMX)``."""
    return f"{os.cpu_count()} cores of {cpu_name()} ({'AMX' if has_amx() else 'no AMX'})"
