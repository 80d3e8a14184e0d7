"""The server's log, bounded: a record of a kind already logged in the last REPEAT_WINDOW seconds is counted
instead of written, and the count is said once when the window ends ("41 more like this in the last 10 s: ...").

A kind is the logger, the message's template (before its arguments are filled in) and the exception's type, so a
client hanging up mid-upload a thousand times a second, or one bug failing every request, writes a line (and, for
an unexpected error, one traceback) per window, never one per request. Records whose exception is one of `drop`'s
types are not written at all (their news was logged in our own words where they were raised)."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass

REPEAT_WINDOW = 10.0
SUMMARY = "repeat_summary"  # the attribute marking our own count lines, which always pass


@dataclass
class _Kind:
    start: float  # when the window opened (the first record of the kind was written)
    logger: str
    level: int
    first_line: str
    count: int = 0  # records counted, not written, since start


class RepeatFilter(logging.Filter):
    def __init__(self, window: float = REPEAT_WINDOW, drop: tuple[type[BaseException], ...] = ()):
        super().__init__()
        self.window, self.drop = window, drop
        self.kinds: dict[tuple, _Kind] = {}
        self.lock = threading.Lock()
        self.timer: threading.Timer | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, SUMMARY, False):
            return True
        error = record.exc_info[1] if record.exc_info else None
        if self.drop and isinstance(error, self.drop):
            return False
        key = (record.name, str(record.msg), type(error).__name__ if error else None)
        now = time.monotonic()
        with self.lock:
            kind = self.kinds.get(key)
            if kind is not None and now < kind.start + self.window:
                kind.count += 1
                self._flush_at(kind.start + self.window - now)
                return False
            self.kinds[key] = _Kind(now, record.name, record.levelno, _first_line(record))
        if kind is not None:
            self._say(kind, now)  # the last window's count, before this record opens a new one
        return True

    def flush(self, everything: bool = False) -> None:
        """Say the counts of the windows that have ended (every window's, `everything`), and forget them."""
        now = time.monotonic()
        with self.lock:
            ended = [key for key, kind in self.kinds.items() if everything or now >= kind.start + self.window]
            done = [self.kinds.pop(key) for key in ended]
            self.timer = None
            if not everything and self.kinds and any(kind.count for kind in self.kinds.values()):
                self._flush_at(min(kind.start for kind in self.kinds.values()) + self.window - now)
        for kind in done:
            self._say(kind, now)

    def _flush_at(self, delay: float) -> None:
        """Flush after `delay` seconds (at most one timer waits; the lock is held)."""
        if self.timer is None:
            self.timer = threading.Timer(max(delay, 0.0), self.flush)
            self.timer.daemon = True
            self.timer.start()

    def _say(self, kind: _Kind, now: float) -> None:
        if kind.count:
            logging.getLogger(kind.logger).log(
                kind.level, "%d more like this in the last %.0f s: %s", kind.count,
                min(now - kind.start, self.window), kind.first_line, extra={SUMMARY: True})

    @contextlib.contextmanager
    def installed(self, loggers: list[str]):
        """The filter on these loggers while the block runs; at its end every count still held is said."""
        for name in loggers:
            logging.getLogger(name).addFilter(self)
        try:
            yield self
        finally:
            if self.timer is not None:
                self.timer.cancel()
            self.flush(everything=True)
            for name in loggers:
                logging.getLogger(name).removeFilter(self)


def _first_line(record: logging.LogRecord) -> str:
    try:
        message = record.getMessage()
    except Exception:  # arguments that do not fit the template: logging reports that itself when it writes it
        message = str(record.msg)
    return (message.splitlines() or [""])[0]
