"""Evaluation on a real model: bits per byte against a hand computation, JSONL vs prepared directory, SFT
data; multiple choice on a benchmark a tiny model has memorised (beats chance) and a random one has not
(stays at chance), in JSONL and C-Eval CSV form, zero- and k-shot; samples; errors that name file:line:field.
"""
from __future__ import annotations

import csv
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from nanoforge.core.errors import NanoforgeError
from nanoforge.eval.choice import build_prompt, evaluate_choices, load_benchmark, wilson_interval
from nanoforge.eval.options import EvalOptions
from nanoforge.eval.run import evaluate_data, run_eval, token_byte_lengths
from nanoforge.infer.samples import generate_samples, load_prompts, write_samples

N_QUESTIONS = 48
QUIET = {"progress": False, "log": lambda *a: None}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models decode on one thread


def _line_pairs() -> list[tuple[str, str]]:
    """(line, next line) pairs of Shakespeare verse, or of made-up lines without ../shared."""
    from conftest import shared_data_dir

    shared = shared_data_dir()
    path = shared / "text" / "tinyshakespeare.txt" if shared is not None else None
    if path is not None and path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        pairs = []
        for a, b in zip(lines, lines[1:]):
            if all(20 <= len(x) <= 60 and not x.endswith(":") for x in (a, b)):
                pairs.append((a.strip(), b.strip()))
        pairs = pairs[::7]  # spread out: not all from one speech
    else:
        # Made-up lines of 3 words from 64: short enough that a question and its answer share the memorising
        # run's 64-token windows (the fallback tokenizer splits these words into several tokens each), and
        # distinct enough to be told apart (6 words from 16 were not: 42% accuracy, 4 of 48 answers recalled;
        # these: 100%, 44 of 48).
        rng = random.Random(0)
        words = ("red blue king queen sea stone night day fire crown sword rose river moon star gold owl fox bell "
                 "ship oak wolf hill rain snow wind salt iron bread milk lamp door key road tower cloud horse ring "
                 "bird tree wall boat drum harp leaf seed frost glass silk coal pearl reed swan deer bear frog crow "
                 "lake mill").split()
        pairs = [(" ".join(rng.choice(words) for _ in range(3)), " ".join(rng.choice(words) for _ in range(3)))
                 for _ in range(200)]
    seen, out = set(), []
    for a, b in pairs:
        if a not in seen and b not in seen:
            seen |= {a, b}
            out.append((a, b))
    return out[:N_QUESTIONS + 8]


def _items(pairs, seed: int) -> list[dict]:
    """Question = a line; choices = its true next line and 3 next-lines of other questions."""
    rng = random.Random(seed)
    answers = [b for _, b in pairs]
    items = []
    for i, (a, b) in enumerate(pairs):
        wrong = rng.sample([x for x in answers if x != b], 3)
        choices = wrong[:]
        k = rng.randrange(4)
        choices.insert(k, b)
        items.append({"question": a, "choices": choices, "answer": k, "subject": "act_one" if i % 2 else "act_two"})
    return items


def _write_csv(path, items) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "question", "A", "B", "C", "D", "answer"])
        for i, it in enumerate(items):
            w.writerow([i, it["question"], *it["choices"], "ABCD"[it["answer"]]])


@pytest.fixture(scope="module")
def bench(tmp_path_factory, tiny_tokenizer):
    """A memorised run, the benchmark as JSONL (+ dev JSONL) and as a C-Eval directory, and a random model."""
    from nanoforge.data.prepare import prepare_dataset
    from nanoforge.model.gpt import GPT
    from nanoforge.weights.load import load_model
    from nanoforge.recipes.pretrain import pretrain

    work = tmp_path_factory.mktemp("eval_bench")
    pairs = _line_pairs()
    questions, dev_pairs = pairs[:N_QUESTIONS], pairs[N_QUESTIONS:]
    items, dev_items = _items(questions, 1), _items(dev_pairs, 2)
    with open(work / "bench.jsonl", "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps({**it, "answer": "ABCD"[it["answer"]] if it["answer"] % 2 else it["answer"]},
                               ensure_ascii=False) + "\n")  # letters and indices both
    with open(work / "dev.jsonl", "w", encoding="utf-8") as f:
        for it in dev_items:
            f.write(json.dumps(it, ensure_ascii=False) + "\n")
    for split, its in (("val", items), ("dev", dev_items)):
        (work / "ceval" / split).mkdir(parents=True)
        for subject in ("act_one", "act_two"):
            _write_csv(work / "ceval" / split / f"{subject}_{split}.csv", [i for i in its if i["subject"] == subject])
    (work / "ceval" / "test").mkdir()  # C-Eval's test split: no answers; must not be the one read

    # the training text: every question with its answer, in the prompt format the benchmark uses, in several
    # shuffled orders: with one fixed order the model memorises each answer from the documents before it
    # (measured: train loss 0.01 but 60% accuracy), not from its question
    rng = random.Random(0)
    with open(work / "train.jsonl", "w", encoding="utf-8") as f:
        for _ in range(6):
            for a, b in rng.sample(pairs, len(pairs)):
                f.write(json.dumps({"text": f"Question: {a}\nAnswer: {b}"}, ensure_ascii=False) + "\n")
    prepare_dataset("pretrain", [work / "train.jsonl"], tiny_tokenizer, work / "data", val_fraction=0.0, workers=1,
                    log=lambda *a: None)
    pretrain([str(work / "data")], work / "run", preset="tiny", quiet=True,
             overrides={"max_steps": 300, "d_model": 128, "tensorboard": False, "eval_every": 0, "seq_len": 64,
                        "batch_size": 8, "precision": "fp32", "warmup_steps": 10, "save_every": 0})
    model, tokenizer, _ = load_model(work / "run")
    torch.manual_seed(123)
    random_model = GPT(model.cfg).eval()
    return {"dir": work, "run": work / "run", "model": model, "tokenizer": tokenizer, "random": random_model,
            "items": items}


@pytest.fixture(scope="module")
def untrained(tiny_tokenizer):
    """A random-init tiny model: enough for checks that compare two computations of the same numbers."""
    from nanoforge.core.config import ModelConfig
    from nanoforge.model.gpt import GPT

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128,
                      vocab_size=tiny_tokenizer.vocab_size)
    return GPT(cfg).eval(), tiny_tokenizer


# ---------------------------------------------------------------------------------------------- choices


@pytest.mark.slow  # trains the memorising run (~15 s of CPU, once per module)
def test_memorised_model_beats_chance_and_random_model_does_not(bench):
    trained = evaluate_choices(bench["run"], bench["dir"] / "bench.jsonl", device="cpu", **QUIET)
    rand = evaluate_choices((bench["random"], bench["tokenizer"]), bench["dir"] / "bench.jsonl", device="cpu",
                            **QUIET)
    print("trained", trained["overall"], "\nrandom", rand["overall"])
    t, r = trained["overall"], rand["overall"]
    assert t["n"] == r["n"] == N_QUESTIONS and t["chance"] == pytest.approx(0.25)
    assert t["acc"] >= 0.6 and t["ci95"][0] > 0.25  # clearly above chance
    assert r["ci95"][0] <= 0.25 <= r["ci95"][1]  # indistinguishable from chance
    assert set(trained["subjects"]) == {"act_one", "act_two"}
    assert sum(s["n"] for s in trained["subjects"].values()) == N_QUESTIONS


@pytest.mark.slow  # trains the memorising run (~15 s of CPU, once per module)
def test_ceval_directory_gives_the_same_answers_per_subject(bench):
    """The same questions as CSV files (one per subject, C-Eval layout) score exactly as the JSONL does."""
    from_jsonl = evaluate_choices(bench["run"], bench["dir"] / "bench.jsonl", device="cpu", return_items=True, **QUIET)
    from_csv = evaluate_choices(bench["run"], bench["dir"] / "ceval", fmt="ceval", device="cpu", return_items=True,
                                **QUIET)
    for subject in ("act_one", "act_two"):
        a, b = from_jsonl["subjects"][subject], from_csv["subjects"][subject]
        assert a["n"] == b["n"] == N_QUESTIONS // 2
        assert a["acc"] == b["acc"] and a["acc_sum"] == b["acc_sum"]
    assert from_csv["overall"]["acc"] == from_jsonl["overall"]["acc"]
    assert from_csv["items"][0]["where"].endswith("act_one_val.csv:2")


@pytest.mark.slow  # trains the memorising run (~15 s of CPU, once per module)
def test_k_shot_uses_dev_examples_of_the_subject(bench):
    zero = evaluate_choices(bench["run"], bench["dir"] / "ceval", fmt="ceval", device="cpu", **QUIET)
    two = evaluate_choices(bench["run"], bench["dir"] / "ceval", fmt="ceval", shots=2, device="cpu", **QUIET)
    jsonl_two = evaluate_choices(bench["run"], bench["dir"] / "bench.jsonl", shots=2,
                                 dev_path=bench["dir"] / "dev.jsonl", device="cpu", **QUIET)
    assert zero["prompt_example"].count("Question:") == 1
    assert two["prompt_example"].count("Question:") == 3 and jsonl_two["prompt_example"].count("Question:") == 3
    assert two["prompt_example"] != zero["prompt_example"]
    questions, dev = load_benchmark(bench["dir"] / "ceval", "ceval")
    shot = [d for d in dev if d.subject == questions[0].subject][0]
    assert shot.question in two["prompt_example"] and shot.choices[shot.answer] in two["prompt_example"]
    assert two["overall"]["n"] == N_QUESTIONS and 0 <= two["overall"]["acc"] <= 1
    with pytest.raises(NanoforgeError, match="--shots 2 needs"):
        evaluate_choices(bench["run"], bench["dir"] / "bench.jsonl", shots=2, device="cpu", **QUIET)


def test_prompt_format_and_wilson_interval():
    assert build_prompt("2+2?") == "Question: 2+2?\nAnswer:"
    lo, hi = wilson_interval(30, 48)
    # reference: Wilson interval for 30/48 at z=1.96 (centre 0.6158, half 0.1322)
    assert lo == pytest.approx(0.4836, abs=1e-3) and hi == pytest.approx(0.7480, abs=1e-3)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)


def test_a_multi_megabyte_question_is_scored_on_the_text_that_reaches_the_window(untrained, tmp_path):
    model, tokenizer = untrained
    sentence, window = "the cat sat on the mat. ", model.cfg.max_seq_len
    cap = (window + 1) * tokenizer.max_token_chars  # characters that can reach the window
    moderate = sentence * ((cap - 100) // len(sentence))  # tokenized whole, still longer than the window
    assert len(tokenizer.encode(moderate)) > window
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"question": q, "choices": ["dog", "mat"], "answer": 1}) + "\n"
                            for q in (moderate, sentence * (2_000_000 // len(sentence)))), encoding="utf-8")
    items = evaluate_choices(untrained, path, return_items=True, **QUIET)["items"]
    assert items[0]["logprob"] == pytest.approx(items[1]["logprob"], abs=1e-4)  # the same last window


# ---------------------------------------------------------------------------------------------- bad inputs


def test_bad_csv_row_and_answer_name_file_line_field(tmp_path):
    d = tmp_path / "b"
    d.mkdir()
    (d / "math.csv").write_text("id,question,A,B,C,D,answer\n0,q1,a,b,c,d,A\n1,q2,a,b,c,B\n", encoding="utf-8")
    with pytest.raises(NanoforgeError, match=r"math\.csv:3: columns: has 6 columns but the header has 7"):
        load_benchmark(d, "ceval")
    (d / "math.csv").write_text('id,question,A,B,C,D,answer\n0,"multi\nline q",a,b,c,d,A\n1,q2,a,b,c,d,E\n',
                                encoding="utf-8")
    with pytest.raises(NanoforgeError, match=r"math\.csv:4: answer: 'E' is not one of A, B, C, D"):
        load_benchmark(d, "cmmlu")
    (d / "math.csv").write_text("id,question,A,B,C,D,answer\n0,q1,a,b,c,d,\n", encoding="utf-8")
    with pytest.raises(NanoforgeError, match=r"math\.csv:2: answer: is empty.*val split"):
        load_benchmark(d, "ceval")


def test_bad_jsonl_answer_names_file_line_field(tmp_path):
    path = tmp_path / "b.jsonl"
    good = {"question": "q", "choices": ["a", "b", "c", "d"], "answer": 1}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "answer": 4}) + "\n", encoding="utf-8")
    with pytest.raises(NanoforgeError, match=r"b\.jsonl:2: \"answer\": index 4 is out of range for 4 choices"):
        evaluate_choices("does-not-matter", path, **QUIET)  # fails on the data before loading any model
    path.write_text(json.dumps({**good, "choices": ["a", 3]}) + "\n", encoding="utf-8")
    with pytest.raises(NanoforgeError, match=r"b\.jsonl:1: \"choices\"\[1\]"):
        load_benchmark(path, "jsonl")


# ---------------------------------------------------------------------------------------------- data


def _hand_nll(model, tokenizer, texts, seq_len) -> tuple[float, int]:
    """Total next-token NLL (nats) of [eos] + concatenated documents, in windows of seq_len, one by one."""
    stream = []
    for t in texts:
        stream += tokenizer.encode(t) + [tokenizer.eos_id]
    full = [tokenizer.eos_id] + stream
    total = 0.0
    with torch.no_grad():
        for k in range(0, len(stream), seq_len):
            x = torch.tensor([full[k:k + seq_len]])
            y = torch.tensor(stream[k:k + seq_len])
            total += F.cross_entropy(model(x)[0, :len(y)].double(), y, reduction="sum").item()
    return total, len(stream)


def test_bpb_equals_hand_computation_and_prepared_dir(untrained, tmp_path):
    from nanoforge.data.prepare import prepare_dataset

    model, tokenizer = untrained
    texts = [f"Question: {a}\nAnswer: {b}" for a, b in _line_pairs()[:3]]
    texts.append("春天来了，小河里的冰化了。 Numbers: 3.14 🙂")  # multi-byte characters count as bytes
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    for seq_len, batch_size in ((None, 8), (16, 3)):
        nll, n = _hand_nll(model, tokenizer, texts, seq_len or model.cfg.max_seq_len)
        got = evaluate_data((model, tokenizer), [path], batch_size=batch_size, seq_len=seq_len, device="cpu", **QUIET)
        assert got["tokens"] == n and got["bytes"] == nbytes
        assert got["loss"] == pytest.approx(nll / n, rel=1e-5)
        assert got["bpb"] == pytest.approx(nll / math.log(2) / nbytes, rel=1e-5)
        assert got["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    # the same file prepared beforehand gives the same numbers; max_tokens cuts and counts bytes from tokens
    prepare_dataset("pretrain", [path], tokenizer, tmp_path / "prep", val_fraction=0.0, workers=1, log=lambda *a: None)
    from_jsonl = evaluate_data(untrained, [path], seq_len=16, device="cpu", **QUIET)
    from_dir = evaluate_data(untrained, [tmp_path / "prep"], seq_len=16, device="cpu", **QUIET)
    assert from_dir["bpb"] == pytest.approx(from_jsonl["bpb"], rel=1e-9)
    assert from_dir["tokens"] == from_jsonl["tokens"]
    cut = evaluate_data(untrained, [tmp_path / "prep"], seq_len=16, max_tokens=20, device="cpu", **QUIET)
    assert cut["truncated"] and cut["tokens"] == 20 and 0 < cut["bytes"] < nbytes


def test_plain_text_file_is_scored_whole(untrained, tmp_path):
    """A .txt file is one document: its bits per byte are over exactly its UTF-8 bytes, and equal the same text
    as a one-record JSONL file."""
    text = "".join(f"{a}\n{b}\n\n" for a, b in _line_pairs()[:6]) + "春天来了。\n"
    txt = tmp_path / "val.txt"
    txt.write_text(text, encoding="utf-8")
    jsonl = tmp_path / "val.jsonl"
    jsonl.write_text(json.dumps({"text": text}, ensure_ascii=False) + "\n", encoding="utf-8")
    from_txt = evaluate_data(untrained, [txt], seq_len=16, device="cpu", **QUIET)
    from_jsonl = evaluate_data(untrained, [jsonl], seq_len=16, device="cpu", **QUIET)
    assert from_txt["bytes"] == len(text.encode("utf-8"))
    assert from_txt["tokens"] == from_jsonl["tokens"]
    assert from_txt["bpb"] == pytest.approx(from_jsonl["bpb"], rel=1e-9)


def test_token_byte_table_counts_the_text_bytes(tiny_tokenizer):
    tok = tiny_tokenizer
    table = token_byte_lengths(tok)
    text = "Question: 春天来了 🙂 the end."
    assert int(table[tok.encode(text)].sum()) == len(text.encode("utf-8"))
    assert table[tok.eos_id] == 0 and table[tok.im_end_id] == 0


def test_sft_data_scores_assistant_tokens_and_their_bytes(untrained, tmp_path):
    model, tokenizer = untrained
    convs = [[{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "A tiny model."}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"},
              {"role": "assistant", "content": "你好！"}, {"role": "user", "content": "Again?"},
              {"role": "assistant", "content": "Yes, again and again."}]]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"conversations": c}, ensure_ascii=False) + "\n" for c in convs), "utf-8")
    model.train()  # as the training loop would hand it over: evaluation must not leave it in eval mode
    try:
        got = evaluate_data((model, tokenizer), [path], device="cpu", **QUIET)
        assert model.training
    finally:
        model.eval()
    assert got["kind"] == "sft"
    # hand: NLL of the masked tokens of each rendered conversation
    nll, n = 0.0, 0
    with torch.no_grad():
        for c in convs:
            ids, mask = tokenizer.render_chat(c)
            x, y = torch.tensor([ids[:-1]]), torch.tensor(ids[1:])
            keep = torch.tensor(mask[1:]) == 1
            nll += F.cross_entropy(model(x)[0].double()[keep], y[keep], reduction="sum").item()
            n += int(keep.sum())
    # the supervised text of a turn is all of what the template renders for it (an empty think block, as the
    # tokenizer's thinking template writes one, then the content); <|im_end|> is a control token, 0 bytes
    think = "<think>\n\n</think>\n\n"
    replies = sum(len((think + m["content"]).encode("utf-8")) for c in convs for m in c if m["role"] == "assistant")
    assert got["tokens"] == n and got["bytes"] == replies
    assert got["loss"] == pytest.approx(nll / n, rel=1e-5)
    assert got["bpb"] == pytest.approx(nll / math.log(2) / replies, rel=1e-5)


# ---------------------------------------------------------------------------------------------- samples


def test_samples_default_prompts_and_prompt_files(untrained, tmp_path):
    from nanoforge.infer.generate import SamplingConfig

    model, tokenizer = untrained
    got = generate_samples(model, tokenizer, None, SamplingConfig(temperature=0, max_new_tokens=8))
    assert len(got) == 6 and {"prompt", "text", "finish_reason", "new_tokens"} <= set(got[0])
    assert any("春" in s["prompt"] for s in got) and any("Once" in s["prompt"] for s in got)
    assert all(s["new_tokens"] <= 8 for s in got)
    chat = generate_samples(model, tokenizer, ["hi"], SamplingConfig(temperature=0, max_new_tokens=4), chat=True)
    assert chat[0]["prompt"] == "hi"
    (tmp_path / "p.txt").write_text("Hello\n\nline\\ntwo\n", encoding="utf-8")
    assert load_prompts(tmp_path / "p.txt") == ["Hello", "line\ntwo"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": 3}\n', encoding="utf-8")
    with pytest.raises(NanoforgeError, match=r"p\.jsonl:2: \"prompt\""):
        load_prompts(tmp_path / "p.jsonl")
    path = write_samples(tmp_path, got[:2], step=7)
    lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 2 and lines[0]["step"] == 7 and lines[0]["prompt"] == got[0]["prompt"]


@pytest.mark.slow
def test_run_eval_writes_samples_into_the_run_and_recalls_memorised_text(bench, tmp_path):
    from nanoforge.infer.generate import SamplingConfig

    it = bench["items"][0]
    answer = it["choices"][it["answer"]]
    greedy = generate_samples(bench["model"], bench["tokenizer"], [f"Question: {it['question']}\nAnswer:"],
                              SamplingConfig(temperature=0, max_new_tokens=12))
    assert answer.startswith(greedy[0]["text"].strip()[:8])  # the memorised answer comes back
    (tmp_path / "p.txt").write_text("Hello\nQuestion:\n", encoding="utf-8")
    out = run_eval(bench["run"], EvalOptions(data=[bench["dir"] / "train.jsonl"], bench=bench["dir"] / "bench.jsonl",
                                             samples=True, prompts=tmp_path / "p.txt", device="cpu", quiet=True),
                   log=lambda *a: None)
    lines = (bench["run"] / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(out["samples"]) == 2 == len(lines) and json.loads(lines[0])["step"] == 300
    assert out["data"]["loss"] < 0.5 and out["bench"]["overall"]["n"] == N_QUESTIONS


def test_a_long_context_model_is_scored_in_windows_of_at_most_2048(tmp_path, tiny_tokenizer):
    """A MiniMind-3 import has 32768 positions (its RoPE table): eval's default window stays at 2048."""
    from nanoforge.core.config import build_config
    from nanoforge.model.gpt import GPT
    torch.manual_seed(0)
    model = GPT(build_config("tiny", overrides={"vocab_size": tiny_tokenizer.vocab_size, "max_seq_len": 4096,
                                                "seq_len": 64})[0]).eval()
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} of a long text, "}) + "\n" for i in range(800)))
    score = {n: evaluate_data((model, tiny_tokenizer), [data], seq_len=n, progress=False, log=lambda *a: None)["loss"]
             for n in (2048, 4096, None)}
    assert score[None] == score[2048] != score[4096]
