"""Properties of what reaches an engine from the wire, drawn by hypothesis.

- **Ids and values from the wire**: requests whose labels repeat, equal other
  requests' ids or are not strings, whose priorities, prompts and parameters may
  be of any type. A real EngineCore (in this process: tests/cluster/inproc.py)
  must refuse each bad one by name and serve every other exactly; it never
  crashes, leaks a slot or a block, or loses another request's outputs; and its
  metrics time every request by the engine's own id (queue time is never 0 s).
- **Slow readers and large steps**: clients of the engine channel that stop
  reading at drawn points, outputs of drawn sizes around the frame bound. A
  client that stops reading is dropped with every request it added aborted; the
  others receive every output of theirs, in order; an output too large for a
  frame fails its own request alone.
"""

from __future__ import annotations

import asyncio
import socket

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from iterserve.cluster.engine import channel as engine_channel
from iterserve.cluster.engine.channel import EngineEndpoint
from iterserve.cluster.engine.connection import EngineConnection
from iterserve.cluster.engine.errors import EngineRefusal, InvalidRequestError
from iterserve.scheduler import FakeExecutor, FakeModel, SamplingParams
from iterserve.scheduler.messages import EngineOutput
from tests.cluster.inproc import engine_in_process
from tests.cluster.test_engine_channel import StubCore

VOCAB = 64
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Each request is well formed but for at most one defect; the engine must name it.
DEFECTS = {
    None: {},
    "label": {"label": st.one_of(st.integers(), st.none(), st.binary(max_size=3), st.just("x" * 300))},
    "priority": {"priority": st.one_of(st.text(max_size=3), st.floats(), st.booleans(), st.none(), st.just(1 << 40))},
    "prompt": {"prompt": st.one_of(st.just([]), st.lists(st.integers(VOCAB, 10**6), min_size=1, max_size=3), st.just(["1"]), st.just("12"))},
    "params": {"params": st.one_of(st.just({"max_tokens": "3"}), st.just({"max_tokens": -1}), st.just({"nope": 1}), st.just([1]))},
    "tenant": {"params": st.sampled_from([{"max_tokens": 3, "tenant": t} for t in (7, "", "x" * 200, None)])},
    "slo_ttft_ms": {"params": st.sampled_from([{"max_tokens": 3, "slo_ttft_ms": v} for v in ("soon", -1, 0.0, 1e12)])},
}  # fmt: skip


@st.composite
def requests(draw):
    defect = draw(st.sampled_from(list(DEFECTS)), label="defect")
    request = {
        # Labels repeat and look like the engine's own ids: they are only labels.
        "label": draw(st.one_of(st.sampled_from(["a", "b", "client.0", "client.1", ""]), st.text(max_size=6))),
        "priority": draw(st.integers(-3, 3)),
        "prompt": draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=6)),
        "params": {"max_tokens": draw(st.integers(1, 6)), "temperature": 0.0,
                   "tenant": draw(st.sampled_from(["default", "a", "b"]))},
    }  # fmt: skip
    for name, strategy in DEFECTS[defect].items():
        request[name] = draw(strategy)
    return defect, request


def _metric(core, name: str) -> float:
    text = core.metrics.exposition().decode()
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


@SETTINGS
@given(st.lists(requests(), min_size=1, max_size=10), st.sampled_from(["priority", "fair"]))
def test_an_engine_refuses_what_is_wrong_by_name_and_serves_the_rest_exactly(drawn, policy):
    expected_fake = FakeExecutor(vocab_size=VOCAB, output_len=4)

    async def scenario():
        model = FakeModel(vocab_size=VOCAB, max_model_len=32, output_len=4)
        async with engine_in_process(
            model,
            num_kv_blocks=16,
            block_size=4,
            max_num_seqs=2,
            max_num_batched_tokens=16,
            scheduling_policy=policy,
        ) as (core, client):

            async def one(request):
                try:
                    stream = await client.open(**request)
                except EngineRefusal as refusal:
                    return refusal
                tokens, reason = [], None
                async for batch in stream:
                    for out in batch:
                        tokens += out.token_ids
                        reason = out.finish_reason
                return stream.key, (tokens, reason)

            results = await asyncio.gather(*(one(r) for _, r in drawn))
            for _ in range(100):  # until the loop has gone idle (and checked itself)
                if not core.scheduler.has_work:
                    break
                await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert core.dead_reason is None, core.dead_reason
            assert core.scheduler.stats()["slots_used"] == 0
            assert core.scheduler.blocks.num_used == 0
            core.scheduler.check_integrity()
            served = sum(not isinstance(r, EngineRefusal) for r in results)
            assert client.load == 0  # the client keeps nothing of a refused request
            queue_count = _metric(core, "iterserve_request_queue_time_seconds_count")
            queue_sum = _metric(core, "iterserve_request_queue_time_seconds_sum")
            return results, served, queue_count, queue_sum

    results, served, queue_count, queue_sum = asyncio.run(scenario())
    for (defect, request), result in zip(drawn, results):
        if defect is None:
            key, got = result
            params = SamplingParams(**{k: v for k, v in request["params"].items() if k != "tenant"})
            label = request["label"] or key  # no label: the engine's id names it in logs
            assert got == expected_fake.expected_output(label, params), request
        else:
            assert isinstance(result, InvalidRequestError), (defect, request, result)
            assert defect in str(result) or defect == "params" or "token" in str(result), result
    assert queue_count == served
    assert queue_sum > 0 or not served  # timed by the engine's id: never 0 s


@st.composite
def channel_workloads(draw):
    num_clients = draw(st.integers(2, 3))
    slow = draw(st.sets(st.integers(0, num_clients - 1), min_size=1, max_size=num_clients - 1))
    # Per step, the sizes (tokens) of each client's two requests' outputs: past
    # ~2700 tokens an output is larger than the 8 KiB frame bound set below.
    size = st.one_of(st.integers(1500, 2600), st.integers(1500, 2600), st.integers(0, 4000))
    steps = draw(st.lists(st.lists(size, min_size=2, max_size=2), min_size=2, max_size=10))
    return num_clients, slow, steps


def _expected(sent: list[EngineOutput]) -> list[EngineOutput]:
    """What a client that reads everything gets: the outputs, until one too large
    for a frame, which fails its request instead; else the end."""
    got = []
    for output in sent:
        frames, too_large = engine_channel.output_frames([output])
        if too_large:
            return got + [engine_channel.codec.decode(frames[0][5:]).outputs[0]]
        got.append(output)
    return got + [EngineOutput(output.request_id, [], finish_reason="length")]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(channel_workloads())
def test_slow_readers_are_dropped_and_every_other_client_gets_all_of_its_outputs(workload):
    num_clients, slow, steps = workload

    async def scenario():
        core = StubCore()
        endpoint = EngineEndpoint(core, "127.0.0.1")
        address = {**await endpoint.start(), "replica": "r"}
        clients = [await EngineConnection.connect(address, f"c{i}", True) for i in range(num_clients)]  # fmt: skip
        streams = [[await c.open("l", [1], {}, 0) for _ in range(2)] for c in clients]
        for writer in endpoint.writers:  # little room in the kernel: the engine's buffer fills
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        for i in slow:  # it reads nothing more, until the end
            clients[i].writer.transport.pause_reading()
        sent: dict[str, list[EngineOutput]] = {s.key: [] for ss in streams for s in ss}
        for sizes in steps:
            for i in range(num_clients):
                for stream, size in zip(streams[i], sizes):
                    output = EngineOutput(stream.key, list(range(size)))
                    sent[stream.key].append(output)
                    core.publish(output)
            await asyncio.sleep(0.005)
        for key in sent:
            core.publish(EngineOutput(key, [], finish_reason="length"))
        await asyncio.sleep(0.01)
        for i in slow:
            clients[i].writer.transport.resume_reading()
        received = {}
        for stream in (s for ss in streams for s in ss):
            received[stream.key] = await _read_all(stream)
        dropped = [c.closed for c in clients]
        for c in clients:
            c.close()
        endpoint.close()
        expected = {key: _expected(outputs) for key, outputs in sent.items()}
        return streams, received, expected, dropped, set(core.aborted)

    with _patched(MAX_FRAME_BYTES=8 << 10, MAX_UNSENT_BYTES=32 << 10):
        streams, received, expected, dropped, aborted = asyncio.run(scenario())
    event(f"clients dropped: {sum(dropped)}")
    event(f"outputs too large: {any(want_error(w) for w in expected.values())}")
    for i, client_streams in enumerate(streams):
        assert not dropped[i] or i in slow, "only a client that stopped reading is dropped"
        for stream in client_streams:
            got, want = received[stream.key], expected[stream.key]
            if got == want:
                continue
            # Dropped before all of it left: a prefix of it, then the channel's end,
            # and the request aborted on the engine.
            assert dropped[i], (stream.key, got[-1:], want[-1:])
            assert got[:-1] == want[: len(got) - 1]
            assert got[-1].finish_reason == "error" and "went away" in got[-1].error
            assert stream.key in aborted
        if not dropped[i]:
            for stream in client_streams:  # aborted only for an output too large
                assert (stream.key in aborted) == (want_error(expected[stream.key]))


def want_error(outputs: list[EngineOutput]) -> bool:
    return outputs[-1].finish_reason == "error"


async def _read_all(stream) -> list[EngineOutput]:
    got = []
    async for batch in stream:
        got += batch
    return got


class _patched:
    """Sets the engine channel's bounds for one example."""

    def __init__(self, **values):
        self.values = values
        self.saved = {}

    def __enter__(self):
        for name, value in self.values.items():
            self.saved[name] = getattr(engine_channel, name)
            setattr(engine_channel, name, value)

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            setattr(engine_channel, name, value)
