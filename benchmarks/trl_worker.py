"""The TRL side of benchmarks/vs_trl.py. It runs under TRL's own interpreter (--trl-python, a venv outside the
repository) and imports only what TRL's install brings (trl, transformers, torch, datasets), never nanoforge.

    /work/trlvenv/bin/python benchmarks/trl_worker.py JOB.json

JOB.json: {"task": "versions" | "logits" | "sft" | "dpo" | "grpo", "out": RESULT.json, ...}; the task's
settings are in the job (vs_trl.py writes them, the same numbers it gives nanoforge). Writes RESULT.json.
One thread (torch.set_num_threads(1)), fp32, CPU.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
import time
from decimal import Decimal, InvalidOperation

import torch
from transformers import TrainerCallback

torch.set_num_threads(1)


def versions() -> dict:
    import datasets
    import transformers
    import trl
    return {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "datasets": datasets.__version__, "python": sys.version.split()[0]}


def load(hf_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(hf_dir)


def logits(job: dict) -> dict:
    """HF's ids for each text and chat (as the exported tokenizer encodes them), its class, and its logits on
    the ids nanoforge gave (so a tokenizer difference cannot hide a model difference)."""
    model, tok = load(job["hf_dir"])
    out = {"class": type(model).__name__, "text_ids": [tok.encode(t, add_special_tokens=False) for t in job["texts"]],
           "chat_ids": [list(tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True, return_dict=True)
                             ["input_ids"]) for c in job["chats"]]}
    with torch.no_grad():
        out["logits"] = [model(torch.tensor([ids])).logits[0].tolist() for ids in job["ids"]]
    return out


def read_jsonl(path: str, limit: int | None = None) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit] if limit else rows


class Clock(TrainerCallback):
    """Times each optimizer step end to end (data, forward, backward, optimizer, logging), and its phases: the
    trainer methods that `phase` wraps add their time to the step's, and the optimizer phase runs from the
    gradient clipping to the step's end (clip, optimizer.step, scheduler, zero_grad: what nanoforge's optim_ms
    holds)."""

    def __init__(self):
        self.ends: list[float] = [time.perf_counter()]
        self.supervised: list[int] = []
        self.phases: list[dict[str, float]] = []
        self.current: dict[str, float] = {}
        self.clip_start = 0.0

    def phase(self, trainer, method: str, name: str) -> None:
        """Wrap trainer.`method` (on the instance: the trainer calls it through self) to time it as `name`."""
        fn = getattr(trainer, method)

        def timed(*a, **k):
            start = time.perf_counter()
            if name == "optim":
                self.clip_start = start
            try:
                return fn(*a, **k)
            finally:
                self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - start
        setattr(trainer, method, timed)

    def on_train_begin(self, *a, **k):
        self.ends = [time.perf_counter()]

    def on_step_end(self, *a, **k):
        self.ends.append(time.perf_counter())
        self.current["optim"] = self.ends[-1] - self.clip_start
        self.phases.append(self.current)
        self.current = {}

    def summary(self, skip: int = 1) -> dict:
        """Step times without the first `skip` steps (warm-up: the first step allocates everything), and the
        median ms/step of each phase: data (the batch's collation; GRPO: and the rollout: generation, rewards,
        log-probs, its generation apart), forward+backward (training_step less the rollout), optimizer, other
        (the log, callbacks)."""
        steps = [b - a for a, b in zip(self.ends, self.ends[1:])][skip:]
        rows = []
        for total, p in zip(steps, self.phases[skip:]):
            rollout = p.get("rollout", 0.0)  # inside training_step, as nanoforge's rollout is in its data phase
            row = {"rollout": p.get("data", 0.0) + rollout, "fwd_bwd": p.get("train_step", 0.0) - rollout,
                   "optim": p["optim"], **({"generation": p["generation"]} if "generation" in p else {})}
            rows.append({**row, "other": total - row["rollout"] - row["fwd_bwd"] - row["optim"], "step": total})
        phases = {k: 1e3 * statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}
        return {"step_s_median": statistics.median(steps) if steps else None, "step_s": steps,
                "train_s": self.ends[-1] - self.ends[0], "phases_ms": phases}

    def watch(self, trainer) -> None:
        """Time the phases every trainer has (GRPO adds its rollout)."""
        self.phase(trainer, "get_batch_samples", "data")
        self.phase(trainer, "training_step", "train_step")
        self.phase(trainer, "_clip_grad_norm", "optim")


def common_args(job: dict) -> dict:
    """The TrainingArguments every comparison shares with nanoforge's settings (vs_trl.py prints the mapping)."""
    return dict(output_dir=job["work"], max_steps=job["steps"], learning_rate=job["lr"],
                lr_scheduler_type=job.get("schedule", "cosine_with_min_lr"),
                lr_scheduler_kwargs=job.get("schedule_kwargs", {"min_lr_rate": 0.1}),
                warmup_steps=job.get("warmup", 0), weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                adam_epsilon=1e-8, optim="adamw_torch", max_grad_norm=1.0, bf16=False, fp16=False, use_cpu=True,
                seed=0, data_seed=0, logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0,
                disable_tqdm=True, gradient_accumulation_steps=1)


def sft(job: dict) -> dict:
    """SFTTrainer: conversations (MiniMind's "conversations" as "messages"), assistant_only_loss, packed BFD."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, tok = load(job["hf_dir"])
    rows = [{"messages": r["conversations"]} for r in read_jsonl(job["data"], job.get("limit"))]
    clock = Clock()

    class Counting(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            clock.supervised.append(int((inputs["labels"][:, 1:] != -100).sum()))  # the tokens the loss sums
            return super().training_step(model, inputs, num_items_in_batch)

    config = SFTConfig(**common_args(job), per_device_train_batch_size=job["batch"], max_length=job["seq_len"],
                       packing=True, packing_strategy="bfd", assistant_only_loss=True, dataset_num_proc=None)
    trainer = Counting(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tok,
                       callbacks=[clock])
    clock.watch(trainer)
    trainer.train()
    out = clock.summary()
    timed = clock.supervised[1:]
    out["supervised_tokens"] = clock.supervised
    out["supervised_tokens_per_s"] = sum(timed) / sum(out["step_s"]) if out["step_s"] else None
    out["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if job.get("save"):
        trainer.save_model(job["save"])
        tok.save_pretrained(job["save"])
    return out


def dpo(job: dict) -> dict:
    """DPOTrainer, sigmoid loss, reference log-probs precomputed over the whole set before training (timed)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model, tok = load(job["hf_dir"])
    rows = []
    for r in read_jsonl(job["data"], job.get("limit")):  # MiniMind's full chats -> explicit prompt + last turn
        rows.append({"prompt": r["chosen"][:-1], "chosen": r["chosen"][-1:], "rejected": r["rejected"][-1:]})
    clock = Clock()
    ref = {}

    class Timed(DPOTrainer):
        def _precompute_ref_logps(self, dataset, name, batch_size):
            start = time.perf_counter()
            try:
                return super()._precompute_ref_logps(dataset, name, batch_size)
            finally:
                ref[name] = time.perf_counter() - start

    config = DPOConfig(**common_args(job), per_device_train_batch_size=job["batch"], beta=job["beta"],
                       loss_type=["sigmoid"], max_length=job["seq_len"], precompute_ref_log_probs=True,
                       precompute_ref_batch_size=job["batch"] * 2, dataset_num_proc=None)
    trainer = Timed(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tok,
                    callbacks=[clock])
    clock.watch(trainer)
    trainer.train()
    out = clock.summary()
    out["ref_s"] = sum(ref.values())
    out["ref_pairs"] = len(rows)
    out["pairs_per_s"] = job["batch"] / out["step_s_median"] if out["step_s_median"] else None
    out["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return out


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def answer_number(text: str):
    """The first number after the last "####", else the last number (nanoforge.rl.rewards' rule, restated)."""
    found = _NUMBER.findall(text.rsplit("####", 1)[1])[:1] if "####" in text else _NUMBER.findall(text)[-1:]
    try:
        return Decimal(found[0].replace(",", "")) if found else None
    except InvalidOperation:
        return None


def math_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 where the reply's number equals the record's answer (conversational completions: the last message)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if answer_number(t) == Decimal(a) else 0.0 for t, a in zip(texts, answer)]


def grpo(job: dict) -> dict:
    """GRPOTrainer with transformers' generate (no vLLM): prompts x generations replies per step, one update."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tok = load(job["hf_dir"])
    rows = [{"prompt": r["conversations"], "answer": r["answer"]} for r in read_jsonl(job["data"])]
    clock = Clock()
    n = job["prompts"] * job["generations"]
    config = GRPOConfig(**common_args(job), per_device_train_batch_size=n, steps_per_generation=1,
                        num_generations=job["generations"], max_completion_length=job["max_new_tokens"],
                        temperature=job["temperature"], top_p=1.0, top_k=0, beta=job["beta"], epsilon=0.2,
                        loss_type="grpo", scale_rewards="group", num_iterations=1, mask_truncated_completions=False,
                        log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=math_reward, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, callbacks=[clock])
    clock.watch(trainer)
    clock.phase(trainer, "_generate_and_score_completions", "rollout")  # generation, rewards, logps, advantages
    clock.phase(trainer, "_generate", "generation")
    trainer.train()
    out = clock.summary()
    out["rewards"] = [h.get("reward") for h in trainer.state.log_history if "reward" in h]
    trainer.save_model(job["save"])
    tok.save_pretrained(job["save"])
    return out


def main() -> None:
    job = json.load(open(sys.argv[1], encoding="utf-8"))
    task = {"versions": lambda j: {}, "logits": logits, "sft": sft, "dpo": dpo, "grpo": grpo}[job["task"]]
    result = {**task(job), "versions": versions()}
    with open(job["out"], "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
