"""Samples: what a model actually writes for a few fixed prompts. `nanoforge eval --samples` prints them;
training with --sample-every N appends them to RUN/samples.jsonl every N steps, so the same prompts show what
the model has learnt so far. Sampling is fixed-seed, so successive samples differ only by the weights."""
import json
from pathlib import Path
from typing import Sequence

from nanoforge.data.jsonl import DataError, check_input_file, line_json, line_text
from nanoforge.core.device import eval_mode
from nanoforge.infer.generate import SamplingConfig, complete


DEFAULT_PROMPTS = ["春天来了，", "从前有一座山，山里有", "中国的首都是", "Once upon a time, there was a",
                   "The most important thing about learning is", "Water boils at"]


def load_prompts(path) -> list[str]:
    """Prompts from a file: .jsonl with {"prompt": str} per line, or plain text, one prompt per line
    (a literal \\n in a text line stands for a newline)."""
    path = check_input_file(path)
    prompts = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            text = line_text(raw, path, line_no)  # as every JSONL line is read: strict UTF-8, BOM dropped
            if text is None:
                continue
            if path.suffix == ".jsonl":
                obj = line_json(text, path, line_no)
                if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
                    raise DataError("must be a non-empty string", path, line_no, '"prompt"')
                prompts.append(obj["prompt"])
            else:
                prompts.append(text.rstrip("\r\n").replace("\\n", "\n"))
    if not prompts:
        raise DataError("has no prompts", path)
    return prompts


def generate_samples(model, tokenizer, prompts: Sequence[str] | None = None, sampling=None, chat: bool = False,
                     precision: str = "fp32") -> list[dict]:
    """Complete each prompt; return [{"prompt", "text", "finish_reason", "new_tokens"}].

    chat=False continues the prompt as plain text (a base model); chat=True sends it as a user message
    through the chat template and stops at <|im_end|> (an SFT model). sampling defaults to temperature 0.8,
    top_p 0.95, 64 new tokens, seed 0, so samples from successive checkpoints are comparable."""
    prompts = list(DEFAULT_PROMPTS if prompts is None else prompts)
    sampling = sampling or SamplingConfig(temperature=0.8, top_p=0.95, max_new_tokens=64, seed=0)
    if chat:
        ids = [tokenizer.render_chat([{"role": "user", "content": p}], add_generation_prompt=True)[0] for p in prompts]
    else:
        ids = [tokenizer.encode(p) for p in prompts]
    with eval_mode(model):
        done = complete(model, tokenizer, ids, sampling, stop_ids=tokenizer.stop_ids, precision=precision)
    return [{"prompt": p, "text": c.text, "finish_reason": c.finish_reason, "new_tokens": len(c.token_ids)}
            for p, c in zip(prompts, done)]


def write_samples(run_dir, samples: Sequence[dict], step: int | None = None) -> Path:
    """Append samples to RUN/samples.jsonl, one object per sample (with the step, when given)."""
    path = Path(run_dir) / "samples.jsonl"
    with open(path, "a", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps({**({"step": step} if step is not None else {}), **s}, ensure_ascii=False) + "\n")
    return path
