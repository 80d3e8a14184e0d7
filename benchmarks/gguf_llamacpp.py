"""Does a GGUF file from `nanoforge export --format gguf` run in llama.cpp and compute what nanoforge computes?

What it checks, for every GGUF dtype the exporter offers (f32, f16) and every prompt (English, Chinese, mixed):

- tokenization: llama.cpp's `tokenize` of the prompt text (no BOS, no special-token parsing) against ours;
  and whether llama.cpp would insert a BOS token by itself (`add_bos=True`, its default for text prompts);
- greedy decoding: llama.cpp (`llama_cpp.Llama.generate` with temp 0, top_k 1, no repetition penalty) and
  nanoforge (`nanoforge.infer.generate.generate`, temperature 0, the code `nanoforge generate` runs) each
  continue the same prompt token ids for the same number of new tokens, without stopping at end-of-text;
  the table says whether the ids match and the index of the first mismatch;
- logits: with `logits_all=True`, the largest absolute difference between llama.cpp's next-token logits and
  our model's, over the prompt positions and over every position of the sequence llama.cpp generated.
  Every GGUF is run twice: with llama.cpp's default KV cache (f16, what users get; it rounds keys and values,
  about 1e-3 on logits of size 10) and with an f32 KV cache (type_k = type_v = f32), where an f32 GGUF must
  give our logits to float rounding (--f32-tol, default 1e-4);
- the CLI: `nanoforge generate RUN --prompt P --temperature 0 --repetition-penalty 1 ...` prints the same
  continuation as the Python API (up to its first stop token).

The model is a small one trained here with nanoforge's own commands (`nanoforge pretrain --preset tiny` on the
shared tiny mixed English/Chinese corpus, a tokenizer trained on the fly), once with the llama architecture
(tied embeddings) and once with the qwen3 one (QK-norm, untied output head), or the run given with --run.

llama-cpp-python lives in its own venv, outside the repository, and builds from source (about 20-40 minutes
on 2 busy cores):

    python3 -m venv /tmp/llamavenv
    CMAKE_BUILD_PARALLEL_LEVEL=2 /tmp/llamavenv/bin/pip install llama-cpp-python

This script runs in nanoforge's venv and starts that interpreter (--python) for a small child program that
loads each GGUF with `llama_cpp.Llama`, decodes, and writes JSON plus the logits as .npy files:

    .venv/bin/python benchmarks/gguf_llamacpp.py --python /tmp/llamavenv/bin/python --json gguf_llamacpp.json

Exit status 0 when the f32 GGUF matches: same tokenization, no automatic BOS, the same greedy ids with either
KV cache, logits within --f32-tol with the f32 KV cache. f16 GGUFs are reported, not required to match token
for token (f16 weights round, and llama.cpp also rounds activations to f16 for f16 matmuls). Results and the
exact command of the recorded run: docs/perf.md, "GGUF in llama.cpp".
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from data_dir import data_path  # benchmarks/data_dir.py: NANOFORGE_DATA

REPO = Path(__file__).resolve().parents[1]


PROMPTS = [
    "Once upon a time there was a",
    "One day, a boy named Tim and his dog",
    "JOHN OF GAUNT:\nMethinks I am a",
    "且说曹操逃出城外，",
    "黑额鸣冠雉是大型的鸟类，",
    "It's 2004, and 《无字碑歌》 was filmed in  two   spaces",
    # newline runs before text, digits and a tag: where Qwen2's split pattern and GPT-2's differ
    "Q: 12+345=?\n\nA: <think>\n\n</think>\n\nIt is",
]

# name -> extra `nanoforge pretrain` flags; the GGUF architecture follows from the model
VARIANTS = {
    "llama": [],
    "qwen3": ["--qk-norm", "true", "--tie-embeddings", "false"],
}

# Runs under --python (llama-cpp-python's venv): reads a job as JSON on stdin, writes JSON to job["out"].
LLAMA_CHILD = r'''
import json, sys
import numpy as np
import llama_cpp
from llama_cpp import Llama

job = json.load(sys.stdin)
out = {"llama_cpp_version": llama_cpp.__version__, "kv": {}}
for kv, ggml_type in job["kv_types"].items():  # the KV cache's type: llama.cpp's default f16, and f32
    llm = Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_batch=job["n_ctx"], n_threads=job["threads"],
                logits_all=True, verbose=False, seed=0, type_k=ggml_type, type_v=ggml_type)
    out["metadata"] = {k: v for k, v in llm.metadata.items() if k != "tokenizer.chat_template"}
    out.update(n_vocab=llm.n_vocab(), n_ctx_train=llm._model.n_ctx_train(), n_ctx=llm.n_ctx())
    results = out["kv"][kv] = []
    for k, p in enumerate(job["prompts"]):
        raw = p["text"].encode("utf-8")
        tokens = llm.tokenize(raw, add_bos=False, special=False)
        tokens_default = llm.tokenize(raw, add_bos=True, special=True)  # what a text prompt gets by default
        llm.reset()
        new = []
        for t in llm.generate(p["ids"], top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                              repeat_penalty=1.0, reset=True):
            new.append(int(t))
            if len(new) >= job["n_new"]:
                break
        n = llm.n_tokens  # the prompt and every new token but the last went through the model
        scores = np.array(llm.scores[:n], dtype=np.float32)
        np.save(f"{job['logits_prefix']}{kv}-{k}.npy", scores)
        argmax = scores[len(p["ids"]) - 1:].argmax(-1).tolist()
        results.append({
            "tokens": [int(t) for t in tokens], "tokens_default": [int(t) for t in tokens_default],
            "tokens_text": llm.detokenize(tokens).decode("utf-8", "replace"),
            "new_ids": new, "new_text": llm.detokenize(new).decode("utf-8", "replace"),
            "sampler_is_argmax": argmax[:len(new)] == new, "n_scored": n})
    del llm
with open(job["out"], "w", encoding="utf-8") as f:
    json.dump(out, f, ensure_ascii=False)
'''


def nanoforge(*args: str, quiet: bool = False) -> str:
    """Run a `nanoforge` command in this interpreter's environment; its stdout (stops the script on failure)."""
    cmd = [sys.executable, "-m", "nanoforge", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    if not quiet and proc.stderr.strip():
        print(proc.stderr.strip()[-500:], file=sys.stderr)
    return proc.stdout


def gguf_dtypes() -> list[str]:
    """The --dtype choices of `nanoforge export` (what the GGUF exporter supports)."""
    from nanoforge.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if getattr(action, "choices", None) and "export" in action.choices:
            for a in action.choices["export"]._actions:
                if "--dtype" in a.option_strings:
                    return list(a.choices)
    return ["f32"]


def write_fallback_corpus(path: Path) -> Path:
    """A small mixed English/Chinese corpus, for a machine without NANOFORGE_DATA/tiny (our own sentences)."""
    en = ["Once upon a time there was a little cat who liked to sit in the sun.",
          "One day, a boy named Tim and his dog went to the park to play with a red ball.",
          "The girl looked at the big tree and smiled, because the birds were singing."]
    zh = ["从前有一只小猫，它喜欢在阳光下睡觉。", "有一天，小明和他的狗去公园玩红色的球。",
          "春天来了，花儿开了，小鸟在树上唱歌。"]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(300):
            text = " ".join(en[(i + j) % 3] for j in range(3)) + "\n" + "".join(zh[(i + j) % 3] for j in range(3))
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path


def train_run(name: str, flags: list[str], corpus: Path, work: Path, args) -> Path:
    out = work / f"run-{name}"
    start = time.perf_counter()
    nanoforge("pretrain", "--preset", "tiny", "--data", str(corpus), "--out", str(out), "--max-steps",
              str(args.steps), "--batch-size", "16", "--seq-len", "128", "--vocab-size", str(args.vocab_size),
              "--precision", "fp32", "--device", "cpu", "--tensorboard", "false", "--eval-every", "0",
              "--save-every", "0", "--seed", "0", "--quiet", *flags, quiet=True)
    losses = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loss = [m["loss"] for m in losses if "loss" in m][-1]
    print(f"trained {name}: {args.steps} steps in {time.perf_counter() - start:.0f} s, final train loss {loss:.3f}")
    return out


def ours(run: Path, prompts: list[str], n_new: int):
    """Our tokenization, greedy continuation (the Python API the CLI uses) and the model, for each prompt."""
    from nanoforge.infer.generate import SamplingConfig, generate
    from nanoforge.weights.load import load_model

    model, tokenizer, _ = load_model(run, device="cpu")
    rows = []
    for text in prompts:
        ids = tokenizer.encode(text)
        new = generate(model, [ids], SamplingConfig(temperature=0, max_new_tokens=n_new), stop_ids=None)[0]
        rows.append({"ids": ids, "new_ids": new, "new_text": tokenizer.decode(new)})
    return model, tokenizer, rows


def model_logits(model, ids: list[int]):
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().numpy()


def cli_continuation(run: Path, prompt: str, n_new: int) -> str:
    """What `nanoforge generate` prints after the prompt, greedy, with no repetition penalty."""
    out = nanoforge("generate", str(run), "--prompt", prompt, "--temperature", "0", "--top-k", "0", "--top-p", "1",
                    "--repetition-penalty", "1", "--max-new-tokens", str(n_new), "--device", "cpu",
                    "--precision", "fp32", quiet=True)
    assert out.startswith(prompt), (out, prompt)
    return out[len(prompt):].removesuffix("\n")


KV_TYPES = {"f16": 1, "f32": 0}  # GGML_TYPE_F16 (llama.cpp's default KV cache), GGML_TYPE_F32


def run_llama(python: str, gguf: Path, job: dict, work: Path, tag: str) -> dict:
    job = {**job, "gguf": str(gguf), "out": str(work / f"llama-{tag}.json"),
           "logits_prefix": str(work / f"llama-{tag}-logits-"), "kv_types": KV_TYPES}
    proc = subprocess.run([python, "-c", LLAMA_CHILD], input=json.dumps(job), text=True, capture_output=True)
    if proc.returncode:
        sys.exit(f"llama_cpp child failed ({proc.returncode}) on {gguf}:\n{proc.stderr[-4000:]}")
    result = json.loads(Path(job["out"]).read_text(encoding="utf-8"))
    import numpy as np
    for kv, rows in result["kv"].items():
        for k, row in enumerate(rows):
            row["logits"] = np.load(f"{job['logits_prefix']}{kv}-{k}.npy")
    return result


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def short(text: str, width: int) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[:width - 1] + "…"


def compare_run(name: str, run: Path, args, work: Path) -> list[dict]:
    import numpy as np

    model, tokenizer, our_rows = ours(run, PROMPTS, args.new_tokens)
    cfg = model.cfg
    stop_ids = {t for t in (tokenizer.eos_id, tokenizer.im_start_id) if t is not None}
    cli = []
    for text, row in zip(PROMPTS, our_rows):
        cut = next((i for i, t in enumerate(row["new_ids"]) if t in stop_ids), len(row["new_ids"]))
        cli.append(cli_continuation(run, text, args.new_tokens) == tokenizer.decode(row["new_ids"][:cut]))
    print(f"{name}: `nanoforge generate` prints the API's continuation for {sum(cli)}/{len(cli)} prompts")
    job = {"prompts": [{"text": t, "ids": r["ids"]} for t, r in zip(PROMPTS, our_rows)],
           "n_new": args.new_tokens, "n_ctx": cfg.max_seq_len, "threads": args.threads}
    records = []
    for dtype in args.dtypes:
        gguf = work / f"{name}-{dtype}.gguf"
        nanoforge("export", str(run), "--format", "gguf", "--dtype", dtype, "--out", str(gguf), "--force", quiet=True)
        llama = run_llama(args.python, gguf, job, work, f"{name}-{dtype}")
        meta = llama["metadata"]
        arch = meta.get("general.architecture")
        keys = ["general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
                f"{arch}.rope.freq_base", f"{arch}.attention.layer_norm_rms_epsilon", f"{arch}.context_length"]
        print(f"{name}-{dtype}: llama-cpp-python {llama['llama_cpp_version']}, {gguf.stat().st_size / 1e6:.2f} MB, "
              f"n_ctx {llama['n_ctx']}, " + ", ".join(f"{k}={meta.get(k)}" for k in keys))
        for k, (text, row) in enumerate(zip(PROMPTS, our_rows)):
            ids = row["ids"]
            first = llama["kv"]["f16"][k]
            record = {
                "variant": name, "arch": arch, "dtype": dtype, "prompt_index": k, "prompt": text,
                "our_prompt_ids": ids, "llama_prompt_ids": first["tokens"],
                "tokenization_match": first["tokens"] == ids,
                "llama_adds_bos_by_default": first["tokens_default"][:1] != first["tokens"][:1],
                "our_new_ids": row["new_ids"], "our_text": row["new_text"], "cli_matches_api": cli[k],
                "llama_cpp_version": llama["llama_cpp_version"], "gguf_metadata": {k2: meta.get(k2) for k2 in keys},
                "kv": {}}
            for kv, rows in llama["kv"].items():
                theirs = rows[k]
                sequence = ids + theirs["new_ids"][:-1]  # what llama.cpp ran through the model
                mine = model_logits(model, sequence)[:, :cfg.vocab_size]
                assert theirs["logits"].shape[0] == len(sequence), (theirs["logits"].shape, len(sequence))
                diff = np.abs(mine - theirs["logits"][:, :cfg.vocab_size])
                mismatch = first_mismatch(row["new_ids"], theirs["new_ids"])
                record["kv"][kv] = {
                    "ids_match": mismatch is None, "first_mismatch": mismatch, "llama_new_ids": theirs["new_ids"],
                    "llama_text": theirs["new_text"], "texts_match": row["new_text"] == theirs["new_text"],
                    "llama_sampler_is_argmax": theirs["sampler_is_argmax"],
                    "max_abs_logit_diff_prompt": float(diff[:len(ids)].max()),
                    "max_abs_logit_diff_all": float(diff.max()), "logit_scale": float(np.abs(mine).max())}
            records.append(record)
    return records


def print_table(records: list[dict]) -> None:
    """One row per GGUF and prompt; `a / b` = llama.cpp with its default f16 KV cache / with an f32 one."""
    head = ("run", "GGUF", "#", "prompt", "tokens =", "auto BOS", "greedy ids = (KV f16 / f32)", "1st diff",
            "max|dlogit| prompt", "max|dlogit| all (KV f16 / f32)", "CLI = API")
    print("\n| " + " | ".join(head) + " |\n|" + "|".join("---" for _ in head) + "|")
    for r in records:
        f16, f32 = r["kv"]["f16"], r["kv"]["f32"]
        mism = [m["first_mismatch"] for m in (f16, f32)]
        print(f"| {r['variant']} | {r['dtype']} | {r['prompt_index']} | {short(r['prompt'], 22)} | "
              f"{'yes' if r['tokenization_match'] else 'NO'} | {'YES' if r['llama_adds_bos_by_default'] else 'no'} | "
              f"{'yes' if f16['ids_match'] else 'NO'} / {'yes' if f32['ids_match'] else 'NO'} | "
              f"{'-' if mism == [None, None] else ' / '.join('-' if m is None else str(m) for m in mism)} | "
              f"{f16['max_abs_logit_diff_prompt']:.1e} / {f32['max_abs_logit_diff_prompt']:.1e} | "
              f"{f16['max_abs_logit_diff_all']:.1e} / {f32['max_abs_logit_diff_all']:.1e} | "
              f"{'yes' if r['cli_matches_api'] else 'NO'} |")
    print("\ncontinuations (nanoforge / llama.cpp, f32 GGUF, default f16 KV cache; any other that differs):")
    for r in records:
        for kv, m in r["kv"].items():
            if (r["dtype"] == "f32" and kv == "f16") or not m["ids_match"]:
                print(f"  {r['variant']}-{r['dtype']} KV {kv} #{r['prompt_index']} {short(r['prompt'], 40)!r}")
                print(f"    nanoforge: {short(r['our_text'], 110)}")
                print(f"    llama.cpp: {short(m['llama_text'], 110)}{'' if m['texts_match'] else '   <- differs'}")


def verdict_line(records: list[dict], dtypes: list[str], tol: float) -> tuple[bool, str]:
    """Pass: the f32 GGUF tokenizes as we do, adds no BOS, decodes our greedy ids with either KV cache, and
    with an f32 KV cache gives our logits within `tol`. Other dtypes are reported."""
    parts, ok = [], True
    for dtype in dtypes:
        rows = [r for r in records if r["dtype"] == dtype]
        same = {kv: sum(r["kv"][kv]["ids_match"] for r in rows) for kv in KV_TYPES}
        worst = {kv: max(r["kv"][kv]["max_abs_logit_diff_all"] for r in rows) for kv in KV_TYPES}
        tokens = sum(r["tokenization_match"] and not r["llama_adds_bos_by_default"] for r in rows)
        if dtype == "f32":
            ok = tokens == len(rows) and all(n == len(rows) for n in same.values()) and worst["f32"] <= tol
        parts.append(f"{dtype} GGUF: greedy ids identical {same['f16']}/{len(rows)} (f16 KV) and {same['f32']}/"
                     f"{len(rows)} (f32 KV), tokenization {tokens}/{len(rows)}, max |dlogit| {worst['f16']:.1e} "
                     f"(f16 KV) / {worst['f32']:.1e} (f32 KV)")
    return ok, ("PASS" if ok else "FAIL") + ": " + "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter with llama_cpp (default: this one)")
    parser.add_argument("--run", help="compare this run (or checkpoint) instead of training the two small ones")
    parser.add_argument("--corpus", help="pretraining JSONL (default: $NANOFORGE_DATA/tiny/pretrain_tiny.jsonl, "
                                         "else a small corpus the script writes)")
    parser.add_argument("--steps", type=int, default=600, help="pretraining steps of each small run (default 600)")
    parser.add_argument("--vocab-size", type=int, default=2048, help="tokenizer trained with the runs (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt (default 48)")
    parser.add_argument("--dtypes", default="", help="comma-separated GGUF dtypes (default: all the exporter offers)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    parser.add_argument("--f32-tol", type=float, default=1e-4,
                        help="largest logit difference that passes (f32 GGUF, f32 KV cache; default 1e-4)")
    parser.add_argument("--work-dir", help="keep runs, GGUF files and logits here (default: a temporary directory)")
    parser.add_argument("--json", help="write every comparison to this JSON file")
    args = parser.parse_args()
    args.dtypes = args.dtypes.split(",") if args.dtypes else gguf_dtypes()

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gguf-llamacpp-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.run:
            runs = {Path(args.run).name: Path(args.run)}
        else:
            corpus = Path(args.corpus) if args.corpus else data_path("tiny/pretrain_tiny.jsonl", required=False)
            if corpus is None or not corpus.is_file():
                corpus = write_fallback_corpus(work / "corpus.jsonl")
            print(f"corpus: {corpus}")
            runs = {name: train_run(name, flags, corpus, work, args) for name, flags in VARIANTS.items()}
        records = [r for name, run in runs.items() for r in compare_run(name, run, args, work)]
    print_table(records)

    ok, verdict = verdict_line(records, args.dtypes, args.f32_tol)
    print(f"\n{verdict}  ({time.perf_counter() - start:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"verdict": verdict, "pass": ok, "args": vars(args),
                                               "prompts": PROMPTS, "records": records}, indent=1,
                                              ensure_ascii=False) + "\n", encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
