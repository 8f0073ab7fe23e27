"""The client's end of the engine channel (:mod:`~iterserve.cluster.engine.channel`):
a connection to one engine, which opens requests and hands each step's outputs
to their requests' streams. An ingress holds one per engine replica; an
``AsyncEngine`` one to its engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import msgpack

from ...scheduler.messages import EngineOutput
from ..framing import ChannelClosed, connect
from .channel import (
    ABORT,
    ACCEPTED,
    ADD,
    OUTPUTS,
    REFUSED,
    encode,
    read_message,
)
from .errors import (
    EngineUnavailableError,
    InvalidRequestError,
    refusal,
)

logger = logging.getLogger(__name__)


class RequestStream:
    """One request's outputs on a client: batches of :class:`EngineOutput`,
    everything that arrived since the last batch. ``cancel`` aborts the request
    (when it has not finished)."""

    def __init__(self, connection: EngineConnection, key: str):
        self.connection = connection
        self.key = key
        self.outputs: list[EngineOutput] = []
        self.wake = asyncio.Event()
        self.done = False  # a finishing output arrived, or the stream was cancelled

    def feed(self, output: EngineOutput) -> None:
        self.outputs.append(output)
        self.wake.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[EngineOutput]:
        while not self.outputs:
            if self.done:
                raise StopAsyncIteration
            self.wake.clear()
            await self.wake.wait()
        batch, self.outputs = self.outputs, []
        if batch[-1].finished:  # finished (or failed): nothing follows
            self.done = True
            self.connection.streams.pop(self.key, None)
        return batch

    def abort(self) -> None:
        """Asks the engine to abort the request; its last output (``abort``) still
        comes through this stream."""
        if not self.done:
            self.connection.send(ABORT, [self.key])

    def cancel(self) -> None:
        """Aborts the request and stops listening for its outputs."""
        if not self.done:
            self.done = True
            self.connection.streams.pop(self.key, None)
            self.connection.send(ABORT, [self.key])
        self.wake.set()


class EngineConnection:
    """A client's connection to one engine: it opens requests (named
    ``<name>.<n>``, unique as the client's name is), and a reader task hands
    each step's outputs to their requests' streams."""

    def __init__(
        self, name: str, replica: str, reader, writer, on_close: Callable[[EngineConnection], None]
    ):
        self.name = name
        self.replica = replica
        self.reader, self.writer = reader, writer
        self.keys = itertools.count()
        self.streams: dict[str, RequestStream] = {}
        self.pending: dict[str, asyncio.Future] = {}  # ADDs waiting for their answer
        self.closed = False
        self.on_close = on_close
        self.task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(
        cls, endpoint: dict, name: str, local: bool, on_close=lambda connection: None
    ) -> EngineConnection:
        """Connects to the engine that published ``endpoint`` (its ``address`` with
        ``replica``): by its Unix socket when ``local``, else by TCP."""
        address = ("unix", endpoint["unix"]) if local else ("tcp", *endpoint["tcp"])
        reader, writer = await connect(address, bytes.fromhex(endpoint["token"]), name)
        return cls(name, endpoint.get("replica", ""), reader, writer, on_close)

    @property
    def load(self) -> int:
        return len(self.streams) + len(self.pending)

    def send(self, kind: int, body: list) -> None:
        if not self.closed:
            self.writer.write(encode(kind, body))

    async def open(self, label: str, prompt, params: dict, priority: int) -> RequestStream:
        """Queues a request on this engine; raises the :class:`EngineRefusal` of
        :mod:`~iterserve.cluster.engine.errors` that says why it was refused (``unavailable`` when
        the channel is closed)."""
        if self.closed:
            raise EngineUnavailableError(f"the channel to engine {self.replica} is closed")
        key = f"{self.name}.{next(self.keys)}"
        try:  # before anything is registered: a value msgpack cannot carry refuses it here
            message = encode(ADD, [key, label, prompt, params, priority])
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidRequestError(_unsendable(label, prompt, params, priority, exc)) from None
        stream = self.streams[key] = RequestStream(self, key)
        answer = self.pending[key] = asyncio.get_running_loop().create_future()
        self.writer.write(message)
        try:
            refused = await answer
        except BaseException:
            self.pending.pop(key, None)
            stream.cancel()  # a caller cancelled while waiting: abort if it was added
            raise
        if refused is not None:
            self.streams.pop(key, None)
            raise refusal(*refused)
        return stream

    async def _read(self) -> None:
        try:
            while True:
                kind, body = await read_message(self.reader, f"engine {self.replica}")
                if kind == OUTPUTS:
                    streams = self.streams
                    for output in body.outputs:
                        stream = streams.get(output.request_id)
                        if stream is not None:
                            stream.feed(output)
                            if output.finish_reason is not None:  # nothing follows its end
                                del streams[output.request_id]
                elif kind in (ACCEPTED, REFUSED) and body:
                    answer = self.pending.pop(body[0], None)
                    if answer is not None and not answer.done():
                        answer.set_result(None if kind == ACCEPTED else body[1:3])
        except ChannelClosed:
            pass
        except Exception:
            logger.exception("the channel to engine %s failed", self.replica)
        finally:
            self._fail(f"engine {self.replica} went away")

    def _fail(self, message: str) -> None:
        self.closed = True
        self.writer.close()
        for answer in self.pending.values():
            if not answer.done():
                answer.set_result(["unavailable", message])
        self.pending.clear()
        for key, stream in list(self.streams.items()):
            stream.feed(EngineOutput.failed(key, message))
        self.streams.clear()
        self.on_close(self)

    def close(self) -> None:
        self.task.cancel()


def _unsendable(label, prompt, params, priority, exc: Exception) -> str:
    """Which field of a request msgpack cannot carry (an int past 64 bits, an object)."""
    fields = {"label": label, "prompt_token_ids": prompt, "params": params, "priority": priority}
    for name, value in fields.items():
        try:
            msgpack.packb(value, use_bin_type=True)
        except (TypeError, ValueError, OverflowError):
            return f"{name}: cannot be sent to the engine ({exc})"
    return f"the request cannot be sent to the engine ({exc})"
