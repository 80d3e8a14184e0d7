"""Write the nanoforge_mc multiple-choice items (JSONL) for lm-evaluation-harness.

Deterministic (random.Random(SEED)); no network. Two kinds of items, 50 each by default:

* arithmetic: "Question: What is 3 + 4?\nAnswer:" with 4 numeric choices (" 7", " 8", ...),
  single-token and multi-token numbers, so acc_norm differs from acc;
* story: the first sentences of an English story from a MiniMind-format pretraining JSONL ({"text": ...}
  per line; default $NANOFORGE_DATA/tiny/pretrain_tiny.jsonl) as context, its next 3-6 words as the right choice and
  same-length word spans of other stories as the 3 wrong ones (multi-token continuations).

Each line: {"id": str, "kind": str, "question": str, "choices": [str, str, str, str], "label": int}.

Usage: python benchmarks/lmeval/make_data.py --out benchmarks/lmeval/data/nanoforge_mc.jsonl
       [--data DATA/tiny/pretrain_tiny.jsonl] [--n-arith 50] [--n-story 50]
"""

import argparse
import json
import os
import random
import re

SEED = 1234
DEFAULT_DATA = os.path.join(os.environ.get("NANOFORGE_DATA", "data"), "tiny", "pretrain_tiny.jsonl")


def arithmetic_items(rng, n):
    items = []
    ops = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]
    for i in range(n):
        sym, fn = ops[i % 3]
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        if sym == "-" and b > a:
            a, b = b, a
        if sym == "*":
            a, b = rng.randint(2, 12), rng.randint(2, 12)
        ans = fn(a, b)
        wrong = set()
        for delta in rng.sample([-10, -2, -1, 1, 2, 10, 11, -11, 3], 9):
            if len(wrong) == 3:
                break
            if ans + delta >= 0 and ans + delta != ans:
                wrong.add(ans + delta)
        choices = [str(ans)] + [str(w) for w in sorted(wrong)]
        rng.shuffle(choices)
        items.append({
            "id": f"arith-{i}",
            "kind": "arithmetic",
            "question": f"Question: What is {a} {sym} {b}?\nAnswer:",
            "choices": choices,
            "label": choices.index(str(ans)),
        })
    return items


def _english_texts(path):
    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            if text.isascii() and len(text) > 300:
                texts.append(" ".join(text.split()))  # one line, single spaces
    return texts


def story_items(rng, n, path):
    texts = _english_texts(path)
    if len(texts) < 4:
        raise SystemExit(f"{path}: fewer than 4 English records of 300+ characters")
    items = []
    order = list(range(len(texts)))
    rng.shuffle(order)
    for i in range(n):
        idx = order[i % len(order)]
        words = texts[idx].split(" ")
        k = rng.randint(3, 6)
        # a context of 20-45 words ending at a sentence end if one is near, else anywhere
        cut = rng.randint(20, min(45, len(words) - k - 1))
        for j in range(cut, 12, -1):
            if re.search(r"[.!?]$", words[j - 1]):
                cut = j
                break
        context = " ".join(words[:cut])
        right = " ".join(words[cut:cut + k])
        wrong = []
        while len(wrong) < 3:
            other = texts[rng.choice([t for t in order if t != idx])].split(" ")
            s = rng.randint(0, len(other) - k)
            span = " ".join(other[s:s + k])
            if span != right and span not in wrong:
                wrong.append(span)
        choices = [right] + wrong
        rng.shuffle(choices)
        items.append({
            "id": f"story-{i}",
            "kind": "story",
            "question": context,
            "choices": choices,
            "label": choices.index(right),
        })
    return items


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSONL file to write")
    ap.add_argument("--data", default=DEFAULT_DATA, help="pretrain JSONL with English stories")
    ap.add_argument("--n-arith", type=int, default=50)
    ap.add_argument("--n-story", type=int, default=50)
    args = ap.parse_args()
    if args.n_story and not os.path.isfile(args.data):
        ap.error(f"{args.data}: no such file; pass --data, or set NANOFORGE_DATA to a folder with tiny/pretrain_tiny.jsonl")
    rng = random.Random(SEED)
    items = arithmetic_items(rng, args.n_arith)
    if args.n_story:
        items += story_items(rng, args.n_story, args.data)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps(it, ensure_ascii=False) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {len(items)} items to {args.out}")


if __name__ == "__main__":
    main()
