"""`/v1/completions`: raw prompts to continue, as OpenAI's legacy endpoint and lm-evaluation-harness use it.

`prompt` is a string, a list of strings, a list of token ids or a list of lists of token ids (an empty string
continues from <|endoftext|>); several prompts give several choices, prompt-major then `n` (choice k is sample
k % n of prompt k // n). `echo` puts each prompt's text before its choices' text, and with `logprobs` its
tokens' log-probs too (the first token's null: nothing predicts it); `max_tokens: 0` is allowed with `echo`
to score a prompt without generating. `logprobs: N` (0 to 5) gives OpenAI's legacy log-probs
(serve/logprobs.py). `best_of` is accepted only equal to `n`; `suffix` is refused. A streamed reply's chunks
join, per choice, to the whole reply: the same text and the same log-prob entries."""
import json
from typing import Any

from nanoforge.infer.options import is_int
from nanoforge.serve.logprobs import Entry, ReplyEntries, TokenText, legacy_logprobs, prompt_entries
from nanoforge.serve.protocol import (SHARED_FIELDS, Chunks, GenerationRequest, Limits, bad_request, check_fits,
                                      check_known, check_unicode, field, integer, sampling, usage)
from nanoforge.serve.worker import Choice, Piece

COMPLETION_FIELDS = SHARED_FIELDS | {"prompt", "echo", "best_of"}
REFUSED = {"suffix": "this model only continues text; it was not trained to fill in the middle"}
MAX_LOGPROBS = 5  # OpenAI's
MAX_CHOICES = 256  # prompts x n in one request


def parse_completion_request(body: Any, tokenizer, limits: Limits) -> GenerationRequest:
    """A /v1/completions body -> a checked request."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_known(body, COMPLETION_FIELDS, REFUSED)
    field(body, "model", (str,), "a string")
    prompts, texts = read_prompts(body.get("prompt"), tokenizer, limits)
    echo = field(body, "echo", (bool,), "a boolean", False)
    shared = sampling(body, limits, min_tokens=0)
    if shared.max_tokens == 0 and not echo:
        raise bad_request("max_tokens=0 generates nothing: it is allowed only with echo, to score the prompt",
                          param="max_tokens")
    best_of = integer(body, "best_of", None, 1, limits.max_batch)
    if best_of is not None and best_of != shared.n:
        raise bad_request(f"best_of={best_of} is not supported: this server returns every sample it generates, "
                          f"so best_of must equal n ({shared.n}) or be left out", param="best_of")
    logprobs = integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    if len(prompts) * shared.n > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts x n={shared.n} is {len(prompts) * shared.n} choices; at most "
                          f"{MAX_CHOICES} are allowed in one request", param="prompt")
    return GenerationRequest(prompts[0], shared.cfg, shared.stream, shared.include_usage, prompts=prompts,
                             n=shared.n, logit_bias=shared.logit_bias, ignore_eos=shared.ignore_eos,
                             top_logprobs=logprobs, echo=echo, prompt_texts=texts, score_only=shared.max_tokens == 0)


def read_prompts(prompt, tokenizer, limits: Limits) -> tuple[list[list[int]], list[str]]:
    """`prompt` in any of its four shapes -> each prompt's token ids and text."""
    if isinstance(prompt, str) or _is_ids(prompt):
        ids, text = _one_prompt(prompt, "prompt", tokenizer, limits)
        return [ids], [text]
    if not (isinstance(prompt, list) and prompt):
        raise bad_request("prompt is required: a string, a list of strings, a list of token ids or a list of lists "
                          "of token ids", param="prompt")
    if len(prompt) > MAX_CHOICES:
        raise bad_request(f"prompt has {len(prompt)} prompts; at most {MAX_CHOICES} are allowed", param="prompt")
    ids, texts = zip(*(_one_prompt(p, f"prompt[{i}]", tokenizer, limits) for i, p in enumerate(prompt)))
    return list(ids), list(texts)


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(t) for t in value)


def _one_prompt(prompt, where: str, tokenizer, limits: Limits) -> tuple[list[int], str]:
    if isinstance(prompt, str):
        check_unicode(prompt, where)
        # An empty prompt continues from a document boundary, as GPT-2 did from <|endoftext|>.
        ids = tokenizer.encode(prompt) if prompt else [tokenizer.eos_id if tokenizer.eos_id is not None else 0]
        text = prompt
    elif isinstance(prompt, list) and all(is_int(t) for t in prompt):
        if not prompt:
            raise bad_request(f"{where} is an empty list of token ids", param=where)
        bad = next((j for j, t in enumerate(prompt) if not 0 <= t < limits.vocab), None)
        if bad is not None:
            raise bad_request(f"{where}[{bad}] = {prompt[bad]} is not a token id of this model, whose vocabulary is "
                              f"{limits.vocab} tokens", param=where)
        ids, text = list(prompt), tokenizer.decode(prompt)
    else:
        raise bad_request(f"{where} must be a string or a list of token ids (integers), got "
                          f"{json.dumps(prompt)[:60]}", param=where)
    check_fits(ids, limits, where)
    return ids, text


# ------------------------------------------------------------------------------------------------- replies

class TextChunks(Chunks):
    """A /v1/completions reply's chunks (protocol.Chunks); `choice(c)` is one whole choice, the join of its
    chunks. A choice's first chunk carries its echoed prompt, when asked."""
    object = "text_completion"

    def __init__(self, model_name: str, reply_id: str, now: int, req: GenerationRequest, text: TokenText):
        super().__init__(model_name, reply_id, now)
        self.req, self.text = req, text
        self.entries: dict[int, ReplyEntries] = {}  # per choice, from its first piece

    def chunk(self, index: int, text: str, entries: list[Entry] = (), finish: str | None = None) -> dict:
        logprobs = legacy_logprobs(list(entries), self.text) if self.req.top_logprobs is not None else None
        return self.envelope([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}])

    def first(self) -> list[dict]:
        return [self.chunk(0, "")]

    def feed(self, piece: Piece) -> list[dict]:
        out = self._start(piece.index, piece.prompt_logprobs)
        if self.req.score_only:
            return out
        return out + [self.chunk(piece.index, piece.text, self.entries[piece.index].feed(piece))]

    def end(self, choice: Choice, text: str = "") -> list[dict]:
        """The choice's last chunk (`text`: what its pieces did not bring, all of it when nothing was streamed)."""
        out = self._start(choice.index, choice.prompt_logprobs)
        if self.req.score_only:
            return out + [self.chunk(choice.index, "", finish="length")]
        entries = self.entries[choice.index].end(choice)
        return out + [self.chunk(choice.index, text, entries, choice.finish_reason)]

    def choice(self, choice: Choice) -> dict:
        parts = [chunk["choices"][0] for chunk in self.end(choice, choice.text)]
        logprobs = None
        if self.req.top_logprobs is not None:
            logprobs = {key: [x for part in parts for x in part["logprobs"][key]] for key in parts[0]["logprobs"]}
        return {"index": choice.index, "text": "".join(p["text"] for p in parts), "logprobs": logprobs,
                "finish_reason": parts[-1]["finish_reason"]}

    def _start(self, index: int, prompt_scores: list | None) -> list[dict]:
        if index in self.entries:
            return []
        prompt = index // self.req.n
        echoed = self.req.prompt_texts[prompt] if self.req.echo else ""
        self.entries[index] = ReplyEntries(self.text, len(echoed), with_stop=True)
        if not self.req.echo:
            return []
        entries = prompt_entries(self.text, self.req.prompts[prompt], prompt_scores or []) \
            if self.req.prompt_logprobs else []
        return [self.chunk(index, echoed, entries)]


def text_body(model_name: str, reply_id: str, now: int, req: GenerationRequest, choices: list[Choice],
              text: TokenText) -> dict:
    chunks = TextChunks(model_name, reply_id, now, req, text)
    return {"id": reply_id, "object": "text_completion", "created": now, "model": model_name,
            "choices": [chunks.choice(c) for c in choices], "usage": usage(req, choices)}
