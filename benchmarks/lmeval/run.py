"""lm-evaluation-harness on `nanoforge serve` against lm-eval's own `--model hf` on the exported model.

Runs the local multiple-choice task nanoforge_mc (this folder: nanoforge_mc.yaml + make_data.py) twice
with lm-eval's defaults otherwise:

  lm_eval run --model hf --model_args pretrained=EXPORT,dtype=float32 ...
  lm_eval run --model local-completions --model_args model=NAME,base_url=URL/v1/completions,
      tokenizer=EXPORT,tokenizer_backend=huggingface,num_concurrent=1,max_retries=1 ...

(local-completions sends token-id prompts by default: tokenized_requests=True), prints both accuracies and
the per-item agreement side by side, and exits 1 if acc or acc_norm differ or any item's prediction
differs, 3 if the server is not reachable. Fully offline (HF_*_OFFLINE=1), one thread (OMP_NUM_THREADS=1).

lm-eval lives in a virtual environment of its own, never nanoforge's:
  python3 -m venv VENV
  VENV/bin/pip install "lm_eval[api,hf]==0.4.13" torch==2.13.0+cpu

Usage (from anywhere; runs lm-eval in the repository root):
  nanoforge export RUN --format hf --out EXPORT
  nanoforge serve RUN --port 8300 --precision fp32 &
  python3 benchmarks/lmeval/run.py --export EXPORT --url http://127.0.0.1:8300
  python3 benchmarks/lmeval/run.py --export EXPORT --only hf      # the transformers half alone
"""

import argparse
import glob
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TASK = "nanoforge_mc"
DATA = os.path.join(HERE, "data", "nanoforge_mc.jsonl")  # the path nanoforge_mc.yaml names


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def env():
    e = dict(os.environ)
    e.update({
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONHASHSEED": "0",
    })
    return e


def get_json(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def lm_eval(lm_eval_bin, model, model_args, out, extra, log):
    shutil.rmtree(out, ignore_errors=True)
    cmd = [lm_eval_bin, "run", "--model", model, "--model_args", model_args, "--tasks", TASK,
           "--include_path", HERE, "--output_path", out, "--log_samples", *extra]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, env=env(), stdout=f, stderr=subprocess.STDOUT)
    dt = time.perf_counter() - t0
    if rc != 0:
        with open(log) as f:
            tail = f.read()[-4000:]
        print(f"lm_eval --model {model} failed (exit {rc}); the end of {log}:\n{tail}", flush=True)
        return None
    res = sorted(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True))
    smp = sorted(glob.glob(os.path.join(out, "**", f"samples_{TASK}_*.jsonl"), recursive=True))
    with open(res[-1]) as f:
        metrics = json.load(f)["results"][TASK]
    samples = {}
    with open(smp[-1]) as f:
        for line in f:
            s = json.loads(line)
            samples[s["doc_id"]] = s
    return {"metrics": metrics, "samples": samples, "seconds": dt}


def per_item(samples):
    """doc_id -> (logprobs of the choices, predicted index, length-normalised (characters, as lm-eval) predicted index)."""
    out = {}
    for doc_id, s in samples.items():
        lls = [float(r[0]) for r in s["filtered_resps"]]
        norm = [ll / len(c) for ll, c in zip(lls, s["doc"]["choices"])]
        out[doc_id] = (lls, max(range(len(lls)), key=lls.__getitem__),
                       max(range(len(norm)), key=norm.__getitem__))
    return out


def compare(ra, rb):
    """(same, one line of detail) for two lm_eval() results: same acc, acc_norm and per-item predictions."""
    a, b = per_item(ra["samples"]), per_item(rb["samples"])
    diff = max((abs(x - y) for d in a if d in b for x, y in zip(a[d][0], b[d][0])), default=math.inf)
    pred_off = sorted(d for d in a.keys() | b.keys() if d not in a or d not in b or a[d][1] != b[d][1])
    norm_off = sorted(d for d in a.keys() | b.keys() if d not in a or d not in b or a[d][2] != b[d][2])
    ma, mb = ra["metrics"], rb["metrics"]
    same = (ma["acc,none"] == mb["acc,none"] and ma["acc_norm,none"] == mb["acc_norm,none"]
            and not pred_off and not norm_off)
    return same, (f"max |logprob diff| over all choices: {diff:.3g}; items predicted differently: "
                  f"acc {len(pred_off)} {pred_off[:10]}, acc_norm {len(norm_off)} {norm_off[:10]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True, help="the `nanoforge export --format hf` directory")
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    ap.add_argument("--model-name", default=None, help="model field sent (default: the first of /v1/models)")
    ap.add_argument("--only", choices=["hf", "api", "both"], default="both")
    ap.add_argument("--lm-eval", default=os.path.join(
        os.environ.get("LMEVAL_VENV", "lmeval-venv"), "bin", "lm_eval"))
    ap.add_argument("--hf-device", default="cpu")
    ap.add_argument("--limit", default=None, help="lm-eval --limit (items)")
    ap.add_argument("--out", default=os.path.join(HERE, "out"))
    args = ap.parse_args()
    export = os.path.abspath(args.export)
    url = args.url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]

    print(f"cpu: {cpu_model()}; threads: OMP_NUM_THREADS=1; python {platform.python_version()}")
    vpy = os.path.join(os.path.dirname(args.lm_eval), "python")
    ver = subprocess.run([vpy, "-c", "import importlib.metadata as m; print(*(f'{p} {m.version(p)}' "
                          "for p in ('lm_eval','torch','transformers','datasets')), sep='; ')"],
                         capture_output=True, text=True, env=env())
    print((ver.stdout or ver.stderr).strip())
    subprocess.check_call([sys.executable, os.path.join(HERE, "make_data.py"), "--out", DATA])
    extra = ["--limit", args.limit] if args.limit else []
    os.makedirs(args.out, exist_ok=True)

    runs = {}
    if args.only in ("hf", "both"):
        runs["hf"] = lm_eval(args.lm_eval, "hf", f"pretrained={export},dtype=float32",
                             os.path.join(args.out, "hf"), ["--device", args.hf_device, *extra],
                             os.path.join(args.out, "hf.log"))
    if args.only in ("api", "both"):
        try:
            health = get_json(url + "/health")
            name = args.model_name or get_json(url + "/v1/models")["data"][0]["id"]
        except Exception as e:  # noqa: BLE001 - any failure means no usable server
            print(f"server {url} not usable: {e!r}")
            return 3
        print(f"server {url}: health {health}; model {name!r}")
        runs["local-completions"] = lm_eval(
            args.lm_eval, "local-completions",
            f"model={name},base_url={url}/v1/completions,tokenizer={export},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
            os.path.join(args.out, "api"), extra, os.path.join(args.out, "api.log"))

    if any(r is None for r in runs.values()):
        return 1
    print(f"\n{'':22}" + "".join(f"{k:>20}" for k in runs))
    for m in ("acc,none", "acc_stderr,none", "acc_norm,none", "acc_norm_stderr,none"):
        print(f"{m:22}" + "".join(f"{r['metrics'][m]:>20.4f}" for r in runs.values()))
    print(f"{'items':22}" + "".join(f"{len(r['samples']):>20}" for r in runs.values()))
    print(f"{'seconds':22}" + "".join(f"{r['seconds']:>20.1f}" for r in runs.values()))
    if len(runs) < 2:
        return 0

    same, report = compare(*runs.values())
    print(report)
    print("SAME accuracy" if same else "DIFFERENT accuracy or predictions")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
