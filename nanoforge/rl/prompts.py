"""RL prompts: JSONL records -> `PromptRecord`s, checked with `path:line: field: message` errors, and the
deterministic, resumable order in which a run takes them.

Shapes (one file may mix them; every other key of a record is kept in `PromptRecord.extra`):
    chat     {"conversations": [...]} in the SFT schema (data/jsonl.py) up to the reply: it ends with a user
             turn (or a tool result), or with an assistant placeholder whose content is empty (MiniMind's
             rlaif.jsonl), which is dropped. Tools declared on the system message become `tools`.
    gsm8k    {"question": "...", "answer": "... #### 72"} -> one user message; the answer gold is what follows
             the last "####" ("72", commas removed); an answer without "####" is the gold as written.
    agentic  either shape with "gt": the expected answer, a string or a list of strings (MiniMind's agent RL)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from nanoforge.chat.messages import RecordError, _keys, _type_name, has_tool_calls, normalize_conversation
from nanoforge.data.jsonl import DataError, check_input_file, line_json, line_text, validate_record
from nanoforge.core.errors import NanoforgeError

_PLACEHOLDER = {"role": "assistant", "content": ""}
_OWN_KEYS = ("conversations", "question", "answer", "gt")


@dataclass
class PromptRecord:
    """One RL prompt: the conversation to reply to, the gold answer (math reward), the expected answers
    (agent reward), the tools its system message declares, where it came from and the record's other keys."""
    messages: list[dict]
    answer: str | None = None
    gt: list[str] | None = None
    tools: list | None = None
    source: str = ""  # "path:line"
    extra: dict = field(default_factory=dict)

    def reward_record(self) -> dict:
        """The dict a reward function receives: the record's own keys, then messages, answer, gt and `_where`
        (its path:line, for error messages)."""
        return {**self.extra, "messages": self.messages, "answer": self.answer, "gt": self.gt, "_where": self.source}


def prompt_record(obj: Any) -> PromptRecord:
    """One decoded JSON value -> PromptRecord (without source); raises RecordError naming the field."""
    if not isinstance(obj, dict):
        raise RecordError(f"each line must be a JSON object, got {_type_name(obj)}")
    if "conversations" in obj:
        messages = _chat_prompt(obj["conversations"])
    elif "question" in obj:
        messages = [{"role": "user", "content": _nonempty_string(obj["question"], '"question"')}]
    else:
        raise RecordError('expected "conversations" (a chat ending in a user turn) or "question" (GSM8K\'s '
                          f'{{"question", "answer"}}); keys: {_keys(obj)}')
    answer = None if obj.get("answer") is None else _answer_gold(obj["answer"])
    gt = None if obj.get("gt") is None else _expected_answers(obj["gt"])
    extra = {k: v for k, v in obj.items() if k not in _OWN_KEYS}
    return PromptRecord(messages, answer, gt, normalize_conversation(messages)[1], extra=extra)


def _chat_prompt(conversation: Any) -> list[dict]:
    """The messages before the reply. The conversation is checked as an SFT one completed by an empty assistant
    turn (so roles, order and tool fields get SFT's checks and messages); a final assistant turn must be empty."""
    full = conversation
    if isinstance(conversation, list) and conversation and isinstance(conversation[-1], dict):
        role = conversation[-1].get("role")
        if role == "system":
            raise RecordError("has only a system message; an RL prompt needs a user turn to reply to",
                              '"conversations"')
        if role != "assistant":
            full = conversation + [_PLACEHOLDER]
    validate_record("sft", {"conversations": full})
    last = full[-1]
    if full is conversation and (last.get("content") or has_tool_calls(last) or last.get("reasoning_content")):
        raise RecordError("the prompt ends with an assistant turn that has content; an RL prompt ends with a user "
                          "turn, or an assistant placeholder with empty content (dropped)",
                          f'"conversations"[{len(full) - 1}].content')
    return [dict(message) for message in full[:-1]]


def _nonempty_string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RecordError(f"must be a string, got {_type_name(value)}", where)
    if not value.strip():
        raise RecordError("is empty", where)
    return value


def _answer_gold(value: Any) -> str:
    """The gold answer: GSM8K's `... #### 72` -> "72" (commas removed); a number or plain string as written."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    text = _nonempty_string(value, '"answer"')
    if "####" not in text:
        return text.strip()
    gold = text.rsplit("####", 1)[1].strip().replace(",", "")
    if not gold:
        raise RecordError('has nothing after "####" (GSM8K answers end with "#### <number>")', '"answer"')
    return gold


def _expected_answers(value: Any) -> list[str]:
    """"gt": a string or a non-empty list of strings -> list of strings."""
    if isinstance(value, str):
        return [_nonempty_string(value, '"gt"')]
    if not isinstance(value, list) or not value:
        raise RecordError(f"must be a string or a non-empty list of strings, got {_type_name(value)}"
                          + (" (empty)" if value == [] else ""), '"gt"')
    return [_nonempty_string(item, f'"gt"[{i}]') for i, item in enumerate(value)]


# ---------------------------------------------------------------------------------------------- files

def read_prompts(path: str | os.PathLike, limit: int | None = None) -> list[PromptRecord]:
    """Every prompt record of a JSONL file (the first `limit` with a limit), in file order; the first invalid
    record raises DataError `path:line: field: message`."""
    path = check_input_file(path)
    records: list[PromptRecord] = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if limit is not None and len(records) >= limit:
                break
            text = line_text(raw, path, line_no)
            obj = None if text is None else line_json(text, path, line_no)
            if obj is None:
                continue
            try:
                record = prompt_record(obj)
            except RecordError as e:
                raise DataError(e.message, path, line_no, e.field) from None
            record.source = f"{path}:{line_no}"
            records.append(record)
    if not records:
        raise DataError("has no prompt records", path)
    return records


# ---------------------------------------------------------------------------------------------- order

def prompts_sha256(records: list[PromptRecord]) -> str:
    """A digest of the prompts' content in their order (not where they were read from: a moved file is the same)."""
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps([r.messages, r.answer, r.gt, r.tools, r.extra], sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


class PromptIterator:
    """Prompts in a seeded random order per epoch, sharded across ranks, resumable from (epoch, cursor).

    Each step takes the next prompts_per_step * world_size prompts of the epoch's permutation
    (torch.randperm seeded with seed + epoch), continuing into the next epoch's when this one runs out; rank r
    takes its slice [r * prompts_per_step, (r + 1) * prompts_per_step). The position is counted over all ranks,
    so a resumed run (even with another process count) sees exactly the prompts an uninterrupted one would."""

    def __init__(self, records: list[PromptRecord], prompts_per_step: int, seed: int, rank: int = 0,
                 world_size: int = 1):
        if prompts_per_step <= 0 or world_size <= 0 or not 0 <= rank < world_size:
            raise NanoforgeError(f"invalid prompt sharding: {prompts_per_step} prompts per step, rank {rank} of "
                                 f"{world_size}")
        needed = prompts_per_step * world_size
        if len(records) < needed:
            raise NanoforgeError(f"{len(records)} prompts, but one step takes {needed} ({prompts_per_step} per "
                                 f"step x {world_size} processes); add prompts or lower --prompts-per-step")
        self.records, self.prompts_per_step = records, prompts_per_step
        self.seed, self.rank, self.world_size = int(seed), rank, world_size
        self.epoch, self.cursor = 0, 0  # prompts of this epoch's order already taken (by all ranks together)
        self._order_epoch, self._order = None, None

    def _order_for(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._order = torch.randperm(len(self.records), generator=generator).tolist()
            self._order_epoch = epoch
        return self._order

    def next_prompts(self) -> list[PromptRecord]:
        """This rank's prompts of the next step (prompts_per_step of them)."""
        taken: list[int] = []
        needed = self.prompts_per_step * self.world_size
        while needed:
            order = self._order_for(self.epoch)
            take = min(needed, len(order) - self.cursor)
            taken += order[self.cursor:self.cursor + take]
            self.cursor, needed = self.cursor + take, needed - take
            if self.cursor == len(order):
                self.epoch, self.cursor = self.epoch + 1, 0
        mine = taken[self.rank * self.prompts_per_step:(self.rank + 1) * self.prompts_per_step]
        return [self.records[i] for i in mine]

    def state_dict(self) -> dict:
        """Where the run is in the prompts, as JSON-able values (for the checkpoint's state.json), and which
        prompts those are (`prompts_sha256`)."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "num_prompts": len(self.records),
                "prompts_sha256": prompts_sha256(self.records)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; the prompts (by content and order, where the checkpoint records them) and seed
        must be the saved run's (else the position means other prompts). prompts_per_step and the process count
        may change."""
        for key, value in (("seed", self.seed), ("num_prompts", len(self.records))):
            if key in state and state[key] != value:
                raise NanoforgeError(f"cannot resume the prompt position: it was saved with {key}={state[key]} "
                                     f"but this run has {key}={value}; use the same --data and --seed")
        have = prompts_sha256(self.records)
        if state.get("prompts_sha256", have) != have:
            where = self.records[0].source.rsplit(":", 1)[0]
            raise NanoforgeError(f"cannot resume: {where} does not hold the prompts this run trained on: other "
                                 f"records, or the same in another order ({len(self.records)} now, "
                                 f"{state.get('num_prompts')} at the start); the saved position would point at "
                                 "other prompts: resume with the prompts the run started on, or start a new run in "
                                 "another --out")
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or not 0 <= cursor < len(self.records):
            raise NanoforgeError(f"invalid prompt position in checkpoint: epoch {epoch}, cursor {cursor}")
        self.epoch, self.cursor = epoch, cursor
