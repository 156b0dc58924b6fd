"""A process's CPU time and memory, read from /proc (Linux)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def _cpu_s(stat: str) -> float:
    """utime + stime of a /proc/.../stat line, in seconds (fields after the command's
    closing parenthesis, which may itself hold spaces)."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key))


def proc_stat(pid: int) -> tuple[float, float]:
    """(cpu seconds, rss MiB) of a process."""
    with open(f"/proc/{pid}/stat") as stat:
        cpu = _cpu_s(stat.read())
    return cpu, _status_kib(pid, "VmRSS:") / 1024


def children_cpu_s(pid: int) -> float:
    """CPU seconds of the process's child processes now running (the trace exporter)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            children = [int(each) for each in listing.read().split()]
    except OSError:
        return 0.0
    total = 0.0
    for child in children:
        with contextlib.suppress(OSError):
            total += proc_stat(child)[0]
    return total


def peak_rss_mib(pid: int) -> float:
    return _status_kib(pid, "VmHWM:") / 1024


def thread_cpu_s(pid: int, name: str) -> float:
    """CPU seconds of the process's thread called `name`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        if (task / "comm").read_text().strip() == name[:15]:
            return _cpu_s((task / "stat").read_text())
    raise RuntimeError(f"no thread {name!r}")


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of every core since boot (/proc/stat's first line; idle
    and iowait are not busy): two readings give how busy the machine was between them."""
    with open("/proc/stat") as stat:
        fields = [int(each) for each in stat.readline().split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    return total - fields[3] - fields[4], total
