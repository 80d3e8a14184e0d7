"""The demo's questions: asked of the fine-tuned model (greedy, through its chat template) and scored against the
docstring each was made from (demo/corpus.py)."""
from __future__ import annotations

import re
from pathlib import Path

from nanoforge.infer.generate import SamplingConfig, complete
from nanoforge.weights.load import load_model


def held_out_hit(reply: str, keywords: list[str]) -> bool:
    """Whether the reply names one of the keywords as a word of its own, in any case ("JSON" names json). A
    "call" question's keywords leave out the module, since its reply starts by repeating the name from the
    question; one-letter and private arguments ("s", "_nil") are left out too: they name nothing."""
    return any(re.search(rf"(?<!\w){re.escape(k)}(?!\w)", reply, re.IGNORECASE) for k in keywords)


def score_replies(samples: list[dict]) -> dict:
    """in_set: replies equal to the expected answer. held_out: replies that name a keyword of their question
    (held_out_hit), and held_out_exact. chance: what held_out would be for replies that know nothing about
    their question, its mean over random pairings of replies and questions: for each held-out question, the
    share of the other questions' replies that hit its keywords, summed."""
    in_set = [s for s in samples if not s["held_out"]]
    held = [s for s in samples if s["held_out"]]
    chance = sum(sum(held_out_hit(o["reply"], s["keywords"]) for o in samples if o is not s) / (len(samples) - 1)
                 for s in held) if len(samples) > 1 else 0.0
    return {"in_set": sum(s["reply"] == s["expected"] for s in in_set), "in_set_n": len(in_set),
            "held_out": sum(held_out_hit(s["reply"], s["keywords"]) for s in held), "held_out_n": len(held),
            "held_out_exact": sum(s["reply"] == s["expected"] for s in held), "chance": chance}


def score_line(score: dict) -> str:
    return (f"in-set {score['in_set']}/{score['in_set_n']} exact first sentence or signature; held-out "
            f"{score['held_out']}/{score['held_out_n']} name the module or an argument (chance "
            f"{score['chance']:.1f}/{score['held_out_n']}), {score['held_out_exact']}/{score['held_out_n']} exact")


# -------------------------------------------------------------------------------------------------- the run


def ask(run_dir: Path, questions: list[dict], max_new_tokens: int) -> list[dict]:
    """Greedy replies of the fine-tuned model to each question, rendered with the chat template it was
    trained on. finish_reason "stop" means the reply ended where every reply ends (tokenizer.stop_ids: the
    template's <|im_end|>, or end of text) and "length" that it ran on."""
    model, tokenizer, _ = load_model(run_dir)
    prompts = [tokenizer.render_chat([{"role": "user", "content": q["question"]}], add_generation_prompt=True)[0]
               for q in questions]
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens)
    completions = complete(model, tokenizer, prompts, cfg, stop_ids=tokenizer.stop_ids)
    return [{**q, "reply": c.text.strip(), "finish_reason": c.finish_reason, "tokens": len(c.token_ids)}
            for q, c in zip(questions, completions)]


def print_replies(samples: list[dict]) -> None:
    """Each question, its reply and the verdict, for the terminal."""
    for s in samples:
        named = [k for k in s["keywords"] if held_out_hit(s["reply"], [k])]
        if s["held_out"]:
            verdict = "held out of SFT: " + ("names " + ", ".join(named) if named else "names nothing asked")
        else:
            verdict = "in the SFT set: " + ("exact" if s["reply"] == s["expected"] else "not exact")
        print(f"\n  Q ({verdict}): {s['question']}\n  A: {s['reply']}\n     [{s['finish_reason']}, "
              f"{s['tokens']} tokens]  expected: {s['expected']}", flush=True)
