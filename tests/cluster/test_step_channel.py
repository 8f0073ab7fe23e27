"""The step channel on its own (no Ray): framing, the token, errors and closed ends."""

from __future__ import annotations

import asyncio
import socket

import pytest

from iterserve.cluster.framing import hello
from iterserve.cluster.ranks.step_channel import (
    TOKEN_BYTES,
    ChannelClosed,
    RankEndpoint,
    SchedulerChannel,
)

TOKEN = b"t" * TOKEN_BYTES


def echo_rank(local: bool, handler=None) -> RankEndpoint:
    return RankEndpoint(handler or (lambda frame: frame[::-1]), TOKEN, local, "127.0.0.1")


async def one_step(channel: SchedulerChannel, payload: bytes) -> list[bytes]:
    await channel.send(payload)
    return await asyncio.wait_for(channel.recv(), 10)


@pytest.mark.parametrize("local", [True, False], ids=["unix", "tcp"])
async def test_every_rank_answers_each_broadcast_in_order(local):
    ranks = [echo_rank(local) for _ in range(3)]
    channel = await SchedulerChannel.connect([r.address for r in ranks], TOKEN)
    try:
        for payload in (b"abc", b"", bytes(range(256)) * 1000):
            assert await one_step(channel, payload) == [payload[::-1]] * 3
    finally:
        channel.close()


async def test_plans_sent_ahead_are_answered_in_order():
    ranks = [echo_rank(local=True) for _ in range(2)]
    channel = await SchedulerChannel.connect([r.address for r in ranks], TOKEN)
    try:
        for payload in (b"one", b"two", b"three"):
            await channel.send(payload)  # before any reply is read
        for payload in (b"one", b"two", b"three"):
            assert await asyncio.wait_for(channel.recv(), 10) == [payload[::-1]] * 2
    finally:
        channel.close()


async def test_a_connection_without_the_token_is_dropped_and_the_scheduler_still_served():
    rank = echo_rank(local=False)
    _, host, port = rank.address
    intruder = socket.create_connection((host, port))
    intruder.sendall(hello(b"x" * TOKEN_BYTES, "intruder"))
    intruder.settimeout(5)
    try:
        assert intruder.recv(16) == b""  # closed unanswered
    except ConnectionResetError:  # closed with the frame unread: also unanswered
        pass
    intruder.close()
    channel = await SchedulerChannel.connect([rank.address], TOKEN)
    try:
        assert await one_step(channel, b"plan") == [b"nalp"]
    finally:
        channel.close()


async def test_a_failing_step_is_reported_with_its_error_and_the_rank_serves_on():
    def handler(frame: bytes) -> bytes:
        if frame == b"bad":
            raise ValueError("cannot run this plan")
        return b"ok"

    rank = echo_rank(local=True, handler=handler)
    channel = await SchedulerChannel.connect([rank.address], TOKEN)
    try:
        with pytest.raises(RuntimeError, match="rank 0: ValueError: cannot run this plan"):
            await one_step(channel, b"bad")
        assert await one_step(channel, b"good") == [b"ok"]
    finally:
        channel.close()


async def test_a_rank_that_goes_away_mid_step_ends_the_step_at_once():
    # A stand-in rank that takes the plan and dies without answering.
    server = socket.create_server(("127.0.0.1", 0))

    def die_after_reading():
        conn, _ = server.accept()
        conn.recv(1 << 16)
        conn.close()

    dying = asyncio.get_running_loop().run_in_executor(None, die_after_reading)
    channel = await SchedulerChannel.connect([("tcp", *server.getsockname())], TOKEN)
    try:
        with pytest.raises(ChannelClosed, match="rank 0 closed its channel"):
            await one_step(channel, b"plan")
    finally:
        channel.close()
        await dying
        server.close()


async def test_the_unix_socket_lives_in_a_private_directory_removed_once_connected():
    import os
    import stat

    rank = echo_rank(local=True)
    directory = os.path.dirname(rank.address[1])
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    channel = await SchedulerChannel.connect([rank.address], TOKEN)
    try:
        await one_step(channel, b"x")
        assert not os.path.exists(directory)
    finally:
        channel.close()
