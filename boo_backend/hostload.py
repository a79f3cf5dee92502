"""How much of the machine other work took while this process measured something. A leaf:
imports nothing else from boo_backend.

A timing that decides where an op runs (extern.py) is kept in the compile cache for good. On a
shared 2-core VM one taken while another process ran, or while the hypervisor stole cycles,
can be 3x off for ATen's OpenMP kernels and much less for IREE's, and the wrong side then
wins in every later process. `Window` tells such a measurement apart, from /proc/stat (the
host's busy and stolen CPU time) less this process's own CPU time. Where /proc/stat cannot be
read, every window counts as quiet: nothing is known against it.
"""

from __future__ import annotations

import os
import time

# Other work may take up to this many cores on average over a window that still counts as
# quiet. /proc/stat counts in ticks of 10 ms, so a window of 0.1 s on 2 cores sees +-0.1
# cores from rounding alone.
QUIET_CORES = 0.35
# Windows shorter than this are too short to judge from 10 ms ticks: they count as quiet.
_MIN_WINDOW_S = 0.05


def _host_busy_s() -> float | None:
    """Seconds of CPU time all processes and the hypervisor's steal have used since boot."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Window:
    """`with Window() as w: ...`; afterwards `w.others` is the cores (on average over the
    window) that other processes and the hypervisor took, or None where unknown, and
    `w.quiet` says whether that stayed under QUIET_CORES."""

    def __init__(self):
        self.others: float | None = None

    def __enter__(self) -> "Window":
        self._host = _host_busy_s()
        self._own = time.process_time()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        host = _host_busy_s()
        wall = time.perf_counter() - self._wall
        if host is None or self._host is None or wall < _MIN_WINDOW_S:
            return
        own = time.process_time() - self._own
        self.others = max(0.0, (host - self._host - own) / wall)

    @property
    def quiet(self) -> bool:
        return self.others is None or self.others <= QUIET_CORES
