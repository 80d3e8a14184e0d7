"""What the comparisons with other tools measure with: loss curves read at a time or a target loss, which
records nanoforge prepare holds out, and a child process whose process tree's peak memory is sampled. Shared by
the benchmark scripts (vs_minimind.py); its examples run as doctests (`python -m doctest benchmarks/measure.py`,
which tests/test_benchmarks.py runs)."""
from __future__ import annotations

import math
import os
import subprocess
import threading
import time
from pathlib import Path


def is_heldout(i: int, fraction: float) -> bool:
    """nanoforge prepare's validation draw for record i (data/prepare.py; tests/test_benchmarks.py checks that
    prepare's val split is this draw).

    >>> [i for i in range(300) if is_heldout(i, 13 / 300)][:4]
    [23, 46, 69, 92]
    """
    return math.floor((i + 1) * fraction) > math.floor(i * fraction)


def crossing_time(points: list[tuple[float, float]], target: float) -> float | None:
    """First time a loss curve [(seconds, loss), ...] (in time order) reaches `target` (loss <= target),
    linearly interpolated between the two points around the crossing; the first point's time when it is already
    there; None when the curve never gets there. The first crossing of a noisy curve counts.

    >>> curve = [(10.0, 8.0), (20.0, 6.0), (30.0, 5.0)]
    >>> crossing_time(curve, 7.0), crossing_time(curve, 5.5), crossing_time(curve, 5.0)
    (15.0, 25.0, 30.0)
    >>> crossing_time([(10.0, 4.0), (20.0, 3.0)], 5.0), crossing_time([(10.0, 8.0), (20.0, 6.0)], 5.9)
    (10.0, None)
    >>> crossing_time([], 5.0) is None
    True
    >>> crossing_time([(0.0, 9.0), (10.0, 7.0), (20.0, 8.0), (30.0, 6.0)], 7.5)
    7.5
    """
    prev = None
    for t, loss in points:
        if loss <= target:
            if prev is None:
                return t
            t0, l0 = prev
            return t0 + (t - t0) * (l0 - target) / (l0 - loss) if l0 > loss else t
        prev = (t, loss)
    return None


def loss_at(points: list[tuple[float, float]], t: float) -> float | None:
    """The loss a curve [(seconds, loss), ...] had at time t: its last point at or before t (None before the
    first).

    >>> curve = [(10.0, 8.0), (20.0, 6.0), (30.0, 5.0)]
    >>> loss_at(curve, 9.0), loss_at(curve, 10.0), loss_at(curve, 29.9), loss_at(curve, 100.0)
    (None, 8.0, 6.0, 5.0)
    """
    known = [loss for when, loss in points if when <= t]
    return known[-1] if known else None


def tree_rss(pid: int) -> int:
    """Resident bytes of pid and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/statm") as f:
                pages = int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        rss[int(entry)] = pages * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo.extend(children.get(p, []))
    return total


class Proc:
    """A child process with its output to a log file, its launch time and its tree's peak RSS."""

    def __init__(self, cmd: list[str], log: Path, cwd: Path | None = None, env: dict | None = None):
        self.log_path = log
        self.log = open(log, "w")
        self.start = time.time()
        self.p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        self.peak = 0
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self):
        while not self._done.is_set():
            self.peak = max(self.peak, tree_rss(self.p.pid))
            self._done.wait(0.1)

    def wait(self, deadline: float | None = None) -> tuple[int, bool]:
        """Exit code and whether it was stopped at `deadline` (Unix seconds)."""
        stopped = False
        try:
            self.p.wait(timeout=None if deadline is None else max(deadline - time.time(), 0))
        except subprocess.TimeoutExpired:
            stopped = True
            self.stop()
        self.end = time.time()
        self._done.set()
        self._sampler.join()
        self.log.close()
        return self.p.returncode, stopped

    def stop(self):
        os.killpg(self.p.pid, 15)
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, 9)
            self.p.wait()
