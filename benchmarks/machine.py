"""What the benchmarks report about the machine while they measure (shared by ffn.py and
gemv.py, which import it from beside themselves)."""

from __future__ import annotations

import os


class OtherLoad:
    """CPU share that other processes used while a row was measured (from /proc/stat and our
    own os.times()): on a 2-core machine another busy process distorts 2-thread timings."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                vals = [int(v) for v in f.readline().split()[1:]]
        except OSError:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        t = os.times()
        return sum(vals) / hz, (sum(vals) - idle) / hz, t.user + t.system

    def fraction(self) -> float | None:
        end = self._sample()
        if end is None or self.start is None:
            return None
        total, busy, ours = (e - s for e, s in zip(end, self.start))
        return max(0.0, busy - ours) / total if total > 0 else None
