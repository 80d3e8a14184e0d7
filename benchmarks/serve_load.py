"""Load generator for any OpenAI-compatible server on this machine: N streaming clients, M requests in all.

    .venv/bin/python benchmarks/serve_load.py --url http://127.0.0.1:8000/v1 [--model NAME] [--clients 8]
        [--requests 64] [--seed 0] [--prompt-min 10] [--prompt-max 300] [--reply-min 16] [--reply-max 256]
        [--endpoint completions|chat] [--ignore-eos] [--timeout-s 600] [--json out.json] [--label nanoforge]

Works against `nanoforge serve RUN`, vLLM's api_server and `transformers serve` alike, so the same numbers can be
compared between engines serving the same exported model. Only the standard library is used (urllib in threads),
so it runs from any venv. Only 127.0.0.1 / localhost URLs are accepted, and proxies from the environment are
ignored: the load never leaves this machine.

Each request's prompt and reply lengths are drawn from --seed. A prompt is plain text made of words from a small
fixed word list, about one token per word on common tokenizers; the prompt_tokens the server reports are recorded
too. Every request streams (stream=true, stream_options.include_usage=true), with max_tokens = the drawn reply
length and temperature 1.0, seeded per request (the seed is dropped if the server rejects it). `ignore_eos` is sent
only with --ignore-eos (vLLM accepts it; other servers may reject it), so without it replies may end early at EOS.

Reported: the CPU model, clients, requests done/failed, completion tokens/s (all completion tokens / wall time of
the run), time to first token (first chunk with non-empty text) p50/p95 and total latency p50/p95. Completion
tokens come from the final usage chunk, else from the count of non-empty chunks. The run ends after --requests
requests or --timeout-s seconds, whichever comes first; requests still streaming at the deadline count as failed.
"""
from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
WORDS = ("the of and to in is it that was for on are with as his they be at one have this from by hot word but "
         "what some we can out other were all there when up use your how said an each she which do their time if "
         "will way about many then them write would like so these her long make thing see him two has look more "
         "day could go come did number sound no most people my over know water than call first who may down side "
         "been now find").split()


class NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are errors: the load goes to the URL given and nowhere else."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused", headers, fp)


# an empty proxy table: http_proxy and friends in the environment must not reroute local traffic
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), NoRedirect())


@dataclass
class Job:
    index: int
    prompt_words: int
    max_tokens: int
    seed: int
    prompt: str


@dataclass
class Result:
    index: int
    ok: bool
    prompt_words: int
    max_tokens: int
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    usage_reported: bool = False
    ttft_s: float | None = None
    latency_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="base URL with /v1, e.g. http://127.0.0.1:8000/v1 (local only)")
    p.add_argument("--model", default=None, help="model name (default: the first one GET /models lists)")
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default 8)")
    p.add_argument("--requests", type=int, default=64, help="requests in all (default 64)")
    p.add_argument("--seed", type=int, default=0, help="draws the prompts, lengths and per-request seeds")
    p.add_argument("--prompt-min", type=int, default=10, help="shortest prompt, in words ~ tokens (default 10)")
    p.add_argument("--prompt-max", type=int, default=300, help="longest prompt, in words ~ tokens (default 300)")
    p.add_argument("--reply-min", type=int, default=16, help="smallest max_tokens (default 16)")
    p.add_argument("--reply-max", type=int, default=256, help="largest max_tokens (default 256)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="the whole run stops after this (default 600)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--ignore-eos", action="store_true", help='send "ignore_eos": true (vLLM; off by default)')
    p.add_argument("--no-seed", action="store_true", help="send no per-request seed (vLLM 0.32's CPU build "
                   "crashes on seeded requests under load: 'CPU Generator does not use offset')")
    p.add_argument("--json", default=None, help="write the summary and every request's record to this path")
    p.add_argument("--label", default="", help="a name for this run, printed and written to --json")
    args = p.parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.timeout_s <= 0:
        p.error("--clients and --requests must be at least 1 and --timeout-s positive")
    if not (1 <= args.prompt_min <= args.prompt_max and 1 <= args.reply_min <= args.reply_max):
        p.error("need 1 <= --prompt-min <= --prompt-max and 1 <= --reply-min <= --reply-max")
    check_local(args.url)
    args.url = args.url.rstrip("/")
    return args


def check_local(url: str) -> None:
    """Refuse any URL that is not plain http on this machine."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in LOCAL_HOSTS:
        raise SystemExit(f"refusing {url!r}: only http://127.0.0.1, http://localhost or http://[::1] URLs are allowed")


def cpu_model() -> str:
    """The first "model name" line of /proc/cpuinfo (what `grep -m1 "model name" /proc/cpuinfo` shows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def make_jobs(args: argparse.Namespace) -> list[Job]:
    """Every request's prompt, max_tokens and seed, drawn from --seed alone."""
    rng = random.Random(args.seed)
    jobs = []
    for i in range(args.requests):
        n_words = rng.randint(args.prompt_min, args.prompt_max)
        prompt = " ".join(rng.choice(WORDS) for _ in range(n_words))
        jobs.append(Job(i, n_words, rng.randint(args.reply_min, args.reply_max), rng.randrange(2**31), prompt))
    return jobs


def get_json(url: str, timeout: float) -> dict:
    with OPENER.open(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def first_model(base: str) -> str:
    data = get_json(f"{base}/models", timeout=30).get("data") or []
    if not data:
        raise SystemExit(f"{base}/models lists no model; pass --model")
    return data[0]["id"]


def request_body(args: argparse.Namespace, job: Job, send_seed: bool) -> dict:
    body = {"model": args.model, "max_tokens": job.max_tokens, "temperature": 1.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": job.prompt}]
    else:
        body["prompt"] = job.prompt
    if send_seed and not args.no_seed:
        body["seed"] = job.seed
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_text(chunk: dict, endpoint: str) -> tuple[str, str | None]:
    """(text, finish_reason) of one streamed chunk's first choice; ("", None) for a usage-only chunk."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")
    return text or "", choice.get("finish_reason")


def read_stream(resp, res: Result, endpoint: str, start: float, deadline: float) -> None:
    """Read SSE lines until [DONE] or the end of the stream; fill res's timings and token counts."""
    text_chunks = 0
    for raw in resp:
        if time.monotonic() > deadline:
            raise TimeoutError("the run's --timeout-s passed while this request was streaming")
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments, event: lines
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            raise RuntimeError(f"error in stream: {chunk['error']}")
        text, finish = chunk_text(chunk, endpoint)
        if text:
            text_chunks += 1
            if res.ttft_s is None:
                res.ttft_s = time.perf_counter() - start
        res.finish_reason = finish or res.finish_reason
        usage = chunk.get("usage")
        if usage:
            res.usage_reported = True
            res.prompt_tokens = usage.get("prompt_tokens")
            res.completion_tokens = usage.get("completion_tokens") or 0
    if not res.usage_reported:
        res.completion_tokens = text_chunks


class SeedSwitch:
    """Per-request seeds are sent until the server rejects the field once; then never again."""

    def __init__(self):
        self.on = True
        self.lock = threading.Lock()

    def rejected(self, status: int, detail: str) -> bool:
        """True (and off from now on) when an HTTP error looks like a refusal of "seed"."""
        if status in (400, 422) and "seed" in detail.lower():
            with self.lock:
                self.on = False
            return True
        return False


def run_one(args: argparse.Namespace, job: Job, seeds: SeedSwitch, deadline: float) -> Result:
    """Send one streaming request (again without seed if the server refused it) and time it."""
    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    for _ in range(2):
        res = Result(job.index, False, job.prompt_words, job.max_tokens)
        send_seed = seeds.on
        data = json.dumps(request_body(args, job, send_seed)).encode()
        req = urllib.request.Request(args.url + path, data=data, headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            timeout = max(1.0, deadline - time.monotonic())
            with OPENER.open(req, timeout=timeout) as resp:
                read_stream(resp, res, args.endpoint, start, deadline)
            res.latency_s = time.perf_counter() - start
            res.ok = True
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:500]
            if send_seed and seeds.rejected(e.code, detail):
                continue
            res.error = f"HTTP {e.code}: {detail}"
        except Exception as e:  # any failure of one request is recorded, not raised
            res.error = f"{type(e).__name__}: {e}"
        return res
    return res


def worker(args, jobs: queue.Queue, results: list, seeds: SeedSwitch, deadline: float, lock) -> None:
    while time.monotonic() < deadline:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            return
        res = run_one(args, job, seeds, deadline)
        with lock:
            results.append(res)


def run_load(args: argparse.Namespace, jobs: list[Job]) -> tuple[list[Result], float]:
    """All jobs through args.clients threads; -> (results, wall seconds). Bounded by --timeout-s."""
    todo: queue.Queue = queue.Queue()
    for job in jobs:
        todo.put(job)
    results: list[Result] = []
    lock, seeds = threading.Lock(), SeedSwitch()
    start = time.perf_counter()
    deadline = time.monotonic() + args.timeout_s
    threads = [threading.Thread(target=worker, args=(args, todo, results, seeds, deadline, lock), daemon=True)
               for _ in range(args.clients)]
    for t in threads:
        t.start()
    give_up = deadline + 5.0  # a thread still stuck in a read after this grace period is left behind (daemon)
    for t in threads:
        t.join(timeout=max(0.0, give_up - time.monotonic()))
    wall = time.perf_counter() - start
    with lock:
        return sorted(results, key=lambda r: r.index), wall


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between the sorted values; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(args: argparse.Namespace, results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    lats = [r.latency_s for r in ok]
    completion = sum(r.completion_tokens for r in ok)
    prompt_tok = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {
        "label": args.label, "url": args.url, "model": args.model, "endpoint": args.endpoint, "cpu": cpu_model(),
        "clients": args.clients, "requests": args.requests, "done": len(ok), "failed": len(results) - len(ok),
        "not_started": args.requests - len(results), "wall_s": wall, "completion_tokens": completion,
        "completion_tok_s": completion / wall if wall > 0 else None,
        "usage_reported": sum(r.usage_reported for r in ok),
        "prompt_words_mean": statistics.fmean(r.prompt_words for r in ok) if ok else None,
        "prompt_tokens_mean": statistics.fmean(prompt_tok) if prompt_tok else None,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
        "latency_p50_s": percentile(lats, 50), "latency_p95_s": percentile(lats, 95),
        "ignore_eos": args.ignore_eos, "seed": args.seed,
    }


def fmt(x, unit: str = "", digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}{unit}"


def report(s: dict, results: list[Result]) -> None:
    print(f"label:            {s['label'] or '-'}")
    print(f"cpu:              {s['cpu']}")
    print(f"server:           {s['url']}  model={s['model']}  endpoint={s['endpoint']}  ignore_eos={s['ignore_eos']}")
    print(f"clients:          {s['clients']}")
    print(f"requests:         {s['done']} done, {s['failed']} failed, {s['not_started']} not started "
          f"(of {s['requests']}) in {s['wall_s']:.2f} s")
    print(f"completion:       {s['completion_tokens']} tokens, {fmt(s['completion_tok_s'], ' tok/s', 1)} "
          f"(usage reported by {s['usage_reported']} of {s['done']})")
    print(f"prompt:           {fmt(s['prompt_words_mean'], ' words', 1)} mean, "
          f"{fmt(s['prompt_tokens_mean'], ' tokens', 1)} mean as the server counts them")
    print(f"TTFT:             p50 {fmt(s['ttft_p50_s'], ' s')}  p95 {fmt(s['ttft_p95_s'], ' s')}")
    print(f"latency:          p50 {fmt(s['latency_p50_s'], ' s')}  p95 {fmt(s['latency_p95_s'], ' s')}")
    errors = [r for r in results if not r.ok]
    for r in errors[:5]:
        print(f"  request {r.index} failed: {r.error}")
    if len(errors) > 5:
        print(f"  ... and {len(errors) - 5} more failures")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model is None:
        args.model = first_model(args.url)
    results, wall = run_load(args, make_jobs(args))
    summary = summarize(args, results, wall)
    report(summary, results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "requests": [asdict(r) for r in results]}, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if summary["done"] == args.requests else 1


if __name__ == "__main__":
    raise SystemExit(main())
