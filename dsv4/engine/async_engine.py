"""Asynchronous front of the synchronous ``LLMEngine`` for the HTTP server.

The engine is not thread-safe and a step can take long (a big prefill), so it lives on
a thread of its own: every call into it (add, abort, step, stats) happens on that
thread, and the asyncio side only enqueues commands and reads per-request queues.
HTTP handling therefore never waits for a step, and a step never waits for a client.

Lifecycle of a request: ``add_request`` runs the engine's validation on the engine
thread and raises its ``ValueError`` back to the caller (so the server can answer 400
before it starts streaming); the returned ``RequestStream`` yields the request's
``RequestOutput``s up to the finished one. Aborting the stream early (a client that
disconnects) aborts the request, which frees its KV blocks and state slot at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import torch

from dsv4.engine.outputs import CompletionOutput, RequestOutput
from dsv4.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FINISH_ABORT = "abort"


class EngineClosedError(RuntimeError):
    """The engine is shutting down or its thread died; no new requests are accepted."""


class EngineStepError(RuntimeError):
    """A step raised; every request that was in the engine at that moment fails with it."""


class RequestStream:
    """The outputs of one request as an async iterator, ending after the finished one.

    A stream belongs to the event loop that created it; the engine thread hands outputs
    over with ``call_soon_threadsafe``. ``abort()`` is idempotent and a no-op once the
    request finished, so consumers call it unconditionally in a ``finally``.
    ``produced_at`` is the ``time.perf_counter()`` at which the engine thread produced
    the output last returned: latency metrics must not include the time an output
    waited for a busy consumer.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, prompt_token_ids: list[int], n: int) -> None:
        self.request_id = request_id
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[float, RequestOutput | BaseException]] = asyncio.Queue()
        self._done = False
        self.produced_at = time.perf_counter()
        # Engine-thread side: what an abort needs to build the request's final output.
        self._prompt_token_ids = prompt_token_ids
        self._n = n
        self._last: RequestOutput | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        self.produced_at, item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    # engine thread ------------------------------------------------------------------

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            self._last = item
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (time.perf_counter(), item))
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass

    def _aborted_output(self) -> RequestOutput:
        """The request's last output with every unfinished sample marked "abort"."""
        last = self._last or RequestOutput(self.request_id, self._prompt_token_ids, [])
        by_index = {c.index: c for c in last.outputs}
        outputs = []
        for i in range(self._n):
            seen = by_index.get(i)
            if seen is None:
                outputs.append(CompletionOutput(index=i, text="", token_ids=[], finish_reason=FINISH_ABORT))
            else:
                reason = seen.finish_reason or FINISH_ABORT
                outputs.append(replace(seen, finish_reason=reason, text_delta="", token_ids_delta=[]))
        return replace(last, outputs=outputs)


class AsyncEngine:
    """Runs ``engine.step()`` on a dedicated thread whenever the engine has work.

    ``stats()`` is a snapshot the engine thread takes after every step, so a metrics
    scrape never touches the engine concurrently with a step.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.max_model_len: int = engine.max_model_len
        self._cv = threading.Condition()
        # (command, future it resolves or None); run in order on the engine thread.
        self._commands: list[tuple[Callable[[], None], concurrent.futures.Future | None]] = []
        self._accepting = True
        self._stopping = False
        self._thread_done = False  # set under _cv once the engine thread takes no more commands
        self._streams: dict[str, RequestStream] = {}  # engine thread only (len() read by shutdown)
        self._stats: dict = engine.stats()
        # OpenMP thread counts are per thread: without this, torch.set_num_threads() of
        # the caller would not reach the thread that runs the model on CPU.
        self._torch_threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name="dsv4-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread

    @property
    def alive(self) -> bool:
        """Accepting requests: not shutting down and the engine thread is running."""
        return self._accepting and self._thread.is_alive()

    def stats(self) -> dict:
        return self._stats

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
        grammar: Any = None,
    ) -> RequestStream:
        """Admit a request; raises the engine's ``ValueError`` for bad input and
        ``EngineClosedError`` when shutting down."""
        if not self.alive:
            raise EngineClosedError("the engine is shutting down")
        stream = RequestStream(self, request_id, list(prompt_token_ids), params.n)

        def add() -> None:
            self.engine.add_request(
                request_id, prompt_token_ids, params, cache_salt=cache_salt, priority=priority, grammar=grammar
            )
            self._streams[request_id] = stream

        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(add, done)
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The caller went away while the add was queued. The add may still run; this
            # abort is queued behind it, so the request cannot leak.
            self.abort(request_id)
            raise
        return stream

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        """``add_request`` plus iteration; leaving the loop early aborts the request."""
        stream = await self.add_request(request_id, prompt_token_ids, params, **kwargs)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request; unknown or finished ids are a no-op."""
        self._submit(lambda: self._abort(request_id, None), None)

    def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop accepting requests, let in-flight ones run for up to ``grace_s`` seconds,
        abort the rest (their streams end with finish_reason "abort"), join the thread.

        Blocking: from a running event loop, call it in a worker thread.
        """
        self._accepting = False
        with self._cv:
            self._cv.wait_for(lambda: not self._streams or self._thread_done, timeout=grace_s)
            self._stopping = True
            self._cv.notify_all()
        self._thread.join()

    def _submit(self, command: Callable[[], None], future: concurrent.futures.Future | None) -> None:
        with self._cv:
            if not self._thread_done:
                self._commands.append((command, future))
                self._cv.notify_all()
                return
        if future is not None and future.set_running_or_notify_cancel():
            future.set_exception(EngineClosedError("the engine thread is not running"))

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        torch.set_num_threads(self._torch_threads)
        busy = False
        try:
            while True:
                with self._cv:
                    if not busy:
                        self._cv.wait_for(lambda: self._commands or self._stopping)
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for command, future in commands:
                    # An add whose caller was cancelled while it waited here is dropped.
                    if future is not None and not future.set_running_or_notify_cancel():
                        continue
                    try:
                        command()
                    except Exception as exc:
                        future.set_exception(exc)  # only adds raise; they always have a future
                    else:
                        if future is not None:
                            future.set_result(None)
                if stopping:
                    for request_id in list(self._streams):
                        self._abort(request_id, None)
                    self._stats = self.engine.stats()
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                busy = self.engine.has_unfinished_requests()
                self._stats = self.engine.stats()
                if not self._streams:
                    with self._cv:
                        self._cv.notify_all()  # a draining shutdown may be waiting for this
        except BaseException as exc:
            logger.exception("engine thread died")
            self._accepting = False
            self._fail_all(EngineClosedError(f"engine thread died: {exc!r}"))
            raise
        finally:
            with self._cv:
                leftover, self._commands = self._commands, []
                self._thread_done = True
                self._cv.notify_all()
            for _, future in leftover:
                if future is not None and future.set_running_or_notify_cancel():
                    future.set_exception(EngineClosedError("the engine is shutting down"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # The batch failed as a whole and the engine cannot say which request caused
            # it, so every request in flight fails; the server keeps serving new ones.
            logger.exception("engine step failed; failing %d in-flight request(s)", len(self._streams))
            self._fail_all(EngineStepError(f"engine step failed: {exc!r}"))
            return
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted while the step ran
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream._put(output)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._abort(request_id, error)

    def _abort(self, request_id: str, error: BaseException | None) -> None:
        """Free the request in the engine and end its stream: with ``error`` if given,
        else with a final output whose unfinished samples say finish_reason "abort"."""
        stream = self._streams.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort of request %s failed", request_id)
        if stream is not None:
            stream._put(error if error is not None else stream._aborted_output())
