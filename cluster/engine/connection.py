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

from ...scheduler.codec import CodecError
from ...scheduler.messages import DEFAULT_TENANT, EngineOutput, EngineRequest
from ...scheduler.sampling import SamplingParams, SamplingParamsError
from ..framing import ChannelClosed, connect
from .channel import (
    ABORT,
    ACCEPTED,
    ADD,
    NOTICE,
    OUTPUTS,
    REFUSED,
    SERVING,
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
    each step's outputs to their requests' streams. ``state`` is the engine's
    as its last ``NOTICE`` said (``serving`` until one arrives); ``on_notice``
    hears each."""

    def __init__(
        self,
        name: str,
        replica: str,
        reader,
        writer,
        on_close: Callable[[EngineConnection], None],
        on_notice: Callable[[EngineConnection], None] = lambda connection: None,
    ):
        self.name = name
        self.state = SERVING
        self.state_message = ""
        self.on_notice = on_notice
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
        cls,
        endpoint: dict,
        name: str,
        local: bool,
        on_close=lambda connection: None,
        on_notice=lambda connection: None,
    ) -> EngineConnection:
        """Connects to the engine that published ``endpoint`` (its ``address`` with
        ``replica``): by its Unix socket when ``local``, else by TCP."""
        address = ("unix", endpoint["unix"]) if local else ("tcp", *endpoint["tcp"])
        reader, writer = await connect(address, bytes.fromhex(endpoint["token"]), name)
        return cls(name, endpoint.get("replica", ""), reader, writer, on_close, on_notice)

    @property
    def load(self) -> int:
        return len(self.streams) + len(self.pending)

    @property
    def usable(self) -> bool:
        """Open, and its engine takes new requests (not draining, not dead)."""
        return not self.closed and self.state == SERVING

    def send(self, kind: int, body: list) -> None:
        if not self.closed:
            self.writer.write(encode(kind, body))

    async def open(self, label: str, prompt, params: dict, priority: int) -> RequestStream:
        """Queues a request on this engine; raises the :class:`EngineRefusal` of
        :mod:`~iterserve.cluster.engine.errors` that says why it was refused (``unavailable`` when
        the channel is closed). ``params`` are SamplingParams' fields, and may name
        the request's ``lora_name``, ``tenant`` and ``slo_ttft_ms`` besides."""
        if self.closed:
            raise EngineUnavailableError(f"the channel to engine {self.replica} is closed")
        key = f"{self.name}.{next(self.keys)}"
        message = add_message(key, label, prompt, params, priority)  # before anything is kept
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
                elif kind == NOTICE and len(body) == 2:
                    self.state, self.state_message = str(body[0]), str(body[1])
                    self.on_notice(self)
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


class UnsendableError(ValueError):
    """A value of a request the engine's strict decoding would refuse, named."""


def engine_request(key: str, label: str, prompt, params: dict, priority: int) -> EngineRequest:
    """The ``ADD`` record of a request: ``params`` are SamplingParams' fields plus
    what else travels with them (``lora_name``, ``tenant``, ``slo_ttft_ms``)."""
    fields = dict(params)
    lora_name = fields.pop("lora_name", None)
    tenant = fields.pop("tenant", DEFAULT_TENANT)
    slo = fields.pop("slo_ttft_ms", None)
    # What the engine's strict decoding would refuse is refused here, by its name: a
    # record it cannot decode would end the channel, and every request on it.
    if slo is not None and type(slo) is int:
        slo = float(slo)
    for name, value, kind in (
        ("label", label, str),
        ("priority", priority, int),
        ("tenant", tenant, str),
        ("lora_name", lora_name, (str, type(None))),
        ("slo_ttft_ms", slo, (float, type(None))),
    ):
        if type(value) not in (kind if isinstance(kind, tuple) else (kind,)):
            raise UnsendableError(f"{name}: cannot be sent to the engine ({type(value).__name__})")
    if type(prompt) is not list or not all(type(t) is int for t in prompt):
        raise UnsendableError("prompt_token_ids: must be a list of integers")
    return EngineRequest(
        key, label, prompt, SamplingParams(**fields), priority, lora_name, tenant, slo
    )


def add_message(key: str, label: str, prompt, params: dict, priority: int) -> bytes:
    """The ``ADD`` frame of a request, or InvalidRequestError naming what cannot be sent."""
    try:
        return encode(ADD, engine_request(key, label, prompt, params, priority))
    except (UnsendableError, SamplingParamsError) as exc:
        raise InvalidRequestError(str(exc)) from None
    except (CodecError, TypeError, ValueError, OverflowError) as exc:
        raise InvalidRequestError(_unsendable(label, prompt, params, priority, exc)) from None


def _unsendable(label, prompt, params, priority, exc: Exception) -> str:
    """Which field of a request msgpack cannot carry (an int past 64 bits, an object)."""
    fields = {"label": label, "prompt_token_ids": prompt, "params": params, "priority": priority}
    for name, value in fields.items():
        try:
            msgpack.packb(value, use_bin_type=True)
        except (TypeError, ValueError, OverflowError):
            return f"{name}: cannot be sent to the engine ({exc})"
    return f"the request cannot be sent to the engine ({exc})"
