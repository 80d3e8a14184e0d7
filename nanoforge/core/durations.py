"""How a duration is printed, everywhere one is (progress ETA, reports, the demo)."""


def format_duration(seconds: float) -> str:
    """12.3 s, 4m05s, 1h02m03s."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(int(round(seconds)), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m{s:02d}s" if hours else f"{m}m{s:02d}s"
