"""The server's generation thread: one engine (infer/engine/), stepped by one thread, fed by the event loop.

Requests are batched, not queued one after another: each HTTP request becomes engine requests (one per prompt,
each with its n samples), whose sequences the engine decodes together with every other running one, starting
new ones as slots free up (`max_batch` slots). The model and its cache are touched by this thread only. What a
request gets back (a stream's `Piece`s, then one `Choice` per sample) is handed to the event loop through an
asyncio queue per request. A client that goes away or a request past its deadline has its sequences ended
between two steps, which frees their slots at once: the deadline ends them like max_tokens (finish_reason
"length", at least one token generated), a departure abandons them."""
import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.engine import Engine, Request, Sequence
from nanoforge.infer.generate import Completion
from nanoforge.serve.protocol import APIError, GenerationRequest


@dataclass
class Choice(Completion):
    """One sample's whole reply (a Completion), with its choice index (prompt-major, then sample), the top
    log-probs of each sampled token (when asked) and the prompt's log-probs (when asked)."""
    index: int = 0
    top_logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)


@dataclass
class Piece:
    """A streamed piece of choice `index`: its next text, and the tokens sampled since its last piece with their
    log-probs (prompt_logprobs: the prompt's, on a choice's first piece only, when asked)."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list
    prompt_logprobs: list | None = None


@dataclass(eq=False)
class Job:
    """One HTTP request's generation: its engine requests, where its items go, and its limits. `sequences` are
    its samples in choice order, `index` each one's place there, `sent` how many of its tokens went out in
    pieces; `live` counts those not ended yet."""
    requests: list[Request]
    put: callable
    stream: bool
    deadline: float | None
    cancelled: threading.Event = field(default_factory=threading.Event)
    sequences: list[Sequence] = field(default_factory=list)
    index: dict = field(default_factory=dict)
    sent: dict = field(default_factory=dict)
    live: int = 0


def engine_requests(req: GenerationRequest, stop_ids: list[int]) -> list[Request]:
    stops = () if req.ignore_eos else tuple(stop_ids)
    return [Request(list(prompt), req.cfg, stops, n=req.n, logit_bias=req.logit_bias,
                    top_logprobs=req.top_logprobs or 0, prompt_logprobs=req.prompt_logprobs)
            for prompt in req.prompts]


class Worker:
    """The generation thread and its inbox (see the module docstring)."""

    def __init__(self, model, tokenizer, precision: str, max_pending: int, request_timeout: float | None,
                 max_batch: int = 32):
        model.eval()
        self.engine = Engine(model, tokenizer, precision, max_batch=max_batch)
        self.max_pending, self.request_timeout = max_pending, request_timeout
        self.inbox: deque[Job] = deque()
        self.jobs: dict[Sequence, Job] = {}
        self.wake = threading.Event()
        self.stopping = False
        self.pending = 0  # requests accepted and not finished, running or waiting
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="nanoforge-generate", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------------------- the event loop's side

    def check_room(self) -> None:
        """503 when too many requests are in the server already."""
        if self.pending >= self.max_pending:
            raise APIError(503, f"the server is busy: {self.pending} requests are already waiting; retry later",
                           code="server_busy", type="server_error")

    def deadline(self) -> float | None:
        """When a request arriving now must stop generating: the timeout counts its wait for a slot too."""
        return time.monotonic() + self.request_timeout if self.request_timeout else None

    async def complete(self, req: GenerationRequest, stop_ids: list[int]) -> list[Choice]:
        """Every choice of the request, in index order."""
        self.check_room()
        choices = [item async for item in self.stream(req, stop_ids, stream=False)]
        return sorted(choices, key=lambda c: c.index)

    async def stream(self, req: GenerationRequest, stop_ids: list[int], stream: bool = True):
        """Async iterator over the request's pieces (when `stream`) and Choices, as they come, until every choice
        has ended. Leaving the loop early (a client gone) ends the sequences."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop has closed: the server is shutting down
                job.cancelled.set()

        job = Job(engine_requests(req, stop_ids), put, stream, self.deadline())
        left = len(job.requests) * req.n
        with self._lock:
            self.pending += 1
            self.inbox.append(job)
        self.wake.set()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                left -= isinstance(item, Choice)
                if left == 0:
                    return
        finally:
            job.cancelled.set()
            self.wake.set()

    def shutdown(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=30)

    # ------------------------------------------------------------------------------------- the thread's side

    def _loop(self) -> None:
        while not self.stopping:
            self._take_new()
            self._end_early()
            if not self.engine.busy:
                self.wake.wait(timeout=1.0)
                self.wake.clear()
                continue
            try:
                changed = self.engine.step()
            except Exception as e:  # noqa: BLE001 -- every request in the step gets the error, the server goes on
                self._fail_all(e)
                continue
            for seq in changed:
                self._deliver(seq)
        for job in set(self.jobs.values()) | set(self.inbox):
            job.put(NanoforgeError("the server is shutting down"))

    def _take_new(self) -> None:
        while self.inbox:
            with self._lock:
                job = self.inbox.popleft()
            try:
                for request in job.requests:
                    job.sequences += self.engine.submit(request)
            except NanoforgeError as e:
                for seq in job.sequences:
                    self.engine.cancel(seq)
                self._finish(job, e)
                continue
            for i, seq in enumerate(job.sequences):
                self.jobs[seq] = job
                job.index[seq], job.sent[seq] = i, 0
            job.live = len(job.sequences)

    def _end_early(self) -> None:
        """End the sequences of clients that left, and of requests past their deadline (after a first token)."""
        now = time.monotonic()
        for seq, job in list(self.jobs.items()):
            if job.cancelled.is_set():
                self.engine.cancel(seq)
                self._drop(seq)
            elif job.deadline is not None and now >= job.deadline and seq.new_ids:
                self.engine.cancel(seq, "length")
                seq.reply.finish()
                self._deliver(seq)

    def _deliver(self, seq: Sequence) -> None:
        job = self.jobs.get(seq)
        if job is None:
            return
        index = job.index[seq]
        if job.stream:
            text = seq.reply.take(final=seq.done)
            if text:
                job.put(self._piece(job, seq, index, text))
        if seq.done:
            job.put(Choice(seq.text, list(seq.new_ids), seq.finish_reason, seq.stop_id, list(seq.logprobs), index,
                           list(seq.top_logprobs), list(seq.prompt_logprobs)))
            self._drop(seq)

    @staticmethod
    def _piece(job: Job, seq: Sequence, index: int, text: str) -> Piece:
        sent, now = job.sent[seq], len(seq.new_ids)
        job.sent[seq] = now
        return Piece(index, text, seq.new_ids[sent:now], seq.logprobs[sent:now], seq.top_logprobs[sent:now],
                     list(seq.prompt_logprobs) if sent == 0 else None)

    def _drop(self, seq: Sequence) -> None:
        job = self.jobs.pop(seq, None)
        if job is None:
            return
        job.live -= 1
        if job.live == 0:
            with self._lock:
                self.pending -= 1

    def _finish(self, job: Job, error: BaseException) -> None:
        job.put(error)
        with self._lock:
            self.pending -= 1

    def _fail_all(self, error: Exception) -> None:
        for seq, job in list(self.jobs.items()):
            self.engine.cancel(seq)
            job.put(error)
            self._drop(seq)
