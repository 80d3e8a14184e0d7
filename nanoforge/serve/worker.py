"""The server's generation thread: one engine (infer/engine/), stepped by one thread, fed by the event loop.

Requests are batched, not queued one after another: each becomes a sequence of the engine, which decodes every
running sequence together and starts new ones as slots free up (`max_batch` slots). The model and its cache
are touched by this thread only. A stream's text pieces are handed to the event loop through an asyncio queue
per request. A client that goes away or a request past its deadline has its sequence ended between two steps,
which frees its slot at once: the deadline ends it like max_tokens (finish_reason "length", at least one token
generated), a departure abandons it."""
import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.engine import Engine, Request, Sequence
from nanoforge.infer.generate import Completion
from nanoforge.serve.protocol import APIError, GenerationRequest


@dataclass(eq=False)
class Job:
    """One HTTP request's generation: its engine request, where its items go, and its limits."""
    request: Request
    put: callable
    stream: bool
    deadline: float | None
    cancelled: threading.Event = field(default_factory=threading.Event)
    sequences: list[Sequence] = field(default_factory=list)


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

    async def complete(self, req: GenerationRequest, stop_ids: list[int]) -> Completion:
        self.check_room()
        async for item in self.stream(req, stop_ids, stream=False):
            if isinstance(item, Completion):
                return item
        raise NanoforgeError("the generation ended without a reply")  # the server is shutting down

    async def stream(self, req: GenerationRequest, stop_ids: list[int], stream: bool = True):
        """Async iterator over the reply's text pieces (when `stream`), then its Completion. Leaving the loop early
        (a client gone) ends the sequence."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop has closed: the server is shutting down
                job.cancelled.set()

        job = Job(Request(list(req.prompt_ids), req.cfg, tuple(stop_ids)), put, stream, self.deadline())
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
                if isinstance(item, Completion):
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
                job.sequences = self.engine.submit(job.request)
            except NanoforgeError as e:
                self._finish(job, e)
                continue
            for seq in job.sequences:
                self.jobs[seq] = job

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
        if job.stream:
            piece = seq.reply.take(final=seq.done)
            if piece:
                job.put(piece)
        if seq.done:
            job.put(Completion(seq.text, list(seq.new_ids), seq.finish_reason, seq.stop_id, list(seq.logprobs)))
            self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        job = self.jobs.pop(seq, None)
        if job is not None and not any(s in self.jobs for s in job.sequences):
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
