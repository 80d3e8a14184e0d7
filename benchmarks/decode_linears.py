"""A decode step's matmuls: MKL's sgemm (F.linear) against oneDNN over a packed weight (model/linear.py).

    .venv/bin/python benchmarks/decode_linears.py [--threads 1] [--repeats 5]

One thread by default (what the serving comparison pins), fp32, the MiniMind-3 shapes (768 -> 2432, 2432 -> 768,
768 -> 6400), rows 1 to 512. Each (rows, path) is timed `--repeats` times, alternating the two paths, and the
median of each is reported with their ratio; model/linear.py's row range (PACKED_MIN_ROWS..PACKED_MAX_ROWS) comes
from this table."""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(768, 2432), (2432, 768), (768, 6400)]
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 512]


def seconds(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def compare(rows: int, repeats: int) -> tuple[float, float]:
    """Median seconds of one pass over SHAPES, F.linear then packed, at `rows` rows."""
    weights = [torch.randn(n_out, n_in) for n_in, n_out in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    inputs = [torch.randn(rows, n_in) for n_in, _ in SHAPES]
    plain = lambda: [F.linear(x, w) for x, w in zip(inputs, weights)]  # noqa: E731
    fast = lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [None], "")  # noqa: E731
                    for x, p in zip(inputs, packed)]
    calls = max(3, 256 // rows)
    a, b = [], []
    for _ in range(repeats):
        a.append(seconds(plain, calls))
        b.append(seconds(fast, calls))
    return statistics.median(a), statistics.median(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), fp32, shapes {SHAPES}")
    print(f"{'rows':>5} {'F.linear ms':>12} {'packed ms':>10} {'speed-up':>9}")
    with torch.inference_mode():
        for rows in ROWS:
            plain, fast = compare(rows, args.repeats)
            print(f"{rows:>5} {plain * 1e3:>12.3f} {fast * 1e3:>10.3f} {plain / fast:>8.2f}x")


if __name__ == "__main__":
    main()
