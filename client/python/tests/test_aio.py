"""The asyncio client (karakv.aio.Client, grpc.aio) against real daemons: typed errors, the default
target, the heartbeat task, the event stream, the prefix cache and Inspect, concurrent calls and a
daemon restart. test_against_cpp.py checks its outputs byte for byte against the C++ SDK."""
import asyncio

import grpc
import numpy as np
import pytest

import karakv
import karakv.aio

L, HQ, HK, D = 2, 4, 2, 16  # conftest.GEOMETRY


def kv(tokens, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((L, tokens, HK, D)).astype(np.float16),
            rng.standard_normal((L, tokens, HK, D)).astype(np.float16))


def test_typed_errors_and_the_default_target(daemon, monkeypatch):
    monkeypatch.setenv("KARAKV_TARGET", daemon.target)

    async def main():
        async with karakv.aio.Client.attach() as c:
            assert c.target == daemon.target
            with pytest.raises(karakv.NotFound) as e:
                await c.release(987654)
            assert str(e.value).startswith("NOT_FOUND: ReleaseSequence: unknown sequence 987654")
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            with pytest.raises(karakv.InvalidArgument, match="nosuchpolicy"):
                await c.create_sequence("nosuchpolicy")
        assert karakv.AsyncClient is karakv.aio.Client

    asyncio.run(main())


def test_heartbeat_task_keeps_the_lease(start_daemon):
    d = start_daemon("--pool_bytes=4MiB", "--lease_seconds=1")

    async def main():
        async with karakv.aio.Client.attach(d.target) as alive, \
                karakv.aio.Client.attach(d.target, heartbeat=False) as silent:
            seq = await silent.create_sequence()
            await asyncio.sleep(2.5)  # the heartbeat task runs meanwhile
            await alive.create_sequence()
            with pytest.raises(karakv.NotFound, match="session"):
                await silent.append(seq, *kv(1))
            assert (await alive.stats()).lease_expiries == 1

    asyncio.run(main())


def test_event_stream_and_inspect(daemon):
    async def main():
        c = await karakv.aio.Client.attach(daemon.target)
        stream = await c.watch_events()
        seq = await c.create_sequence("streaming", params={"c_max": 24, "c_target": 12, "sinks": 2})
        await c.append(seq, *kv(20))
        (done,) = await c.compact(seq)
        assert done.tokens_after == 12 and done.params["c_target"] == 12
        seen = await c.inspect(seq)
        assert seen.info.length == 12 and seen.positions[0] == [0, 1] + list(range(10, 20))
        await c.detach()
        events = [e async for e in stream]
        assert [(e.kind, e.number) for e in events] == [("compaction", 1), ("session_ended", 2)]
        assert events[0].sequence_id == seq and events[1].sequences_released == 1
        assert await stream.finish() is None
        with pytest.raises(karakv.NotFound, match="unknown session"):
            await c.watch_events()
        await c.close()

    asyncio.run(main())


def test_event_stream_cancel(daemon):
    async def main():
        async with karakv.aio.Client.attach(daemon.target) as c:
            stream = await c.watch_events()
            reader = asyncio.ensure_future(asyncio.wait_for(_drain(stream), 10))
            await asyncio.sleep(0.1)
            stream.cancel()
            assert await reader == []
            err = await stream.finish()
            assert isinstance(err, karakv.Cancelled)

    asyncio.run(main())


async def _drain(stream):
    return [e async for e in stream]


def test_prefix_cache(daemon):
    prompt = list(range(8))
    k, v = kv(8, seed=2)

    async def main():
        async with karakv.aio.Client.attach(daemon.target) as c:
            seq = await c.create_sequence()
            assert await c.append(seq, k, v, token_ids=prompt) == 8
            assert await c.lookup(prompt) == 8
            created = await c.create_from_prefix(prompt + [99])
            assert created.cached_tokens == 8
            rk, _, _ = await c.read_kv(created.id)
            np.testing.assert_array_equal(rk, k)

    asyncio.run(main())


def test_concurrent_calls_share_one_client(daemon):
    async def main():
        async with karakv.aio.Client.attach(daemon.target, fast_path=True) as c:
            seqs = await asyncio.gather(*(c.create_sequence() for _ in range(4)))
            k, v = kv(6)
            lengths = await asyncio.gather(*(c.append(s, k, v) for s in seqs))
            q = np.ones((2, HQ, D), np.float32)
            outs = await asyncio.gather(*(c.attend(s, 1, q) for s in seqs), c.stats(), c.ping())
            for o in outs[1:4]:
                np.testing.assert_array_equal(o, outs[0])
            return sorted(seqs), lengths, c.ring_calls

    seqs, lengths, ring_calls = asyncio.run(main())
    assert len(set(seqs)) == 4 and lengths == [6] * 4 and ring_calls == 8  # 4 Appends, 4 Attends


def test_auto_reattach_after_a_restart(start_daemon):
    d = start_daemon("--pool_bytes=4MiB")

    async def main():
        async with karakv.aio.Client.attach(d.target, staging_bytes=1 << 20) as c:
            old_instance = c.instance_id
            seq = await c.create_sequence()
            await c.append(seq, *kv(3))
            d.crash_and_restart()
            assert await c.list_sequences() == []  # re-attached, then repeated on the new session
            assert c.instance_id != old_instance
            with pytest.raises(karakv.DaemonRestarted, match="re-prefill"):
                await c.read_kv(seq)
            fresh = await c.create_sequence()
            assert fresh != seq and await c.append(fresh, *kv(3)) == 3

    asyncio.run(main())


def test_append_batch_through_the_ring_and_grpc(daemon):
    """The asyncio client's append_batch: each entry's length, the ring used on the fast path, and the
    same cache as the blocking client's separate appends."""
    (k1, v1), (k2, v2) = kv(3, seed=1), kv(2, seed=2)

    async def main():
        async with karakv.aio.Client.attach(daemon.target, fast_path=True) as fast, \
                karakv.aio.Client.attach(daemon.target) as plain:
            got = []
            for c in (fast, plain):
                a, b = await c.create_sequence(), await c.create_sequence()
                before = c.ring_calls
                assert await c.append_batch([(a, k1, v1), (b, k2, v2), (a, k2, v2)]) == [3, 2, 5]
                assert c.ring_calls - before == (1 if c is fast else 0)
                got.append([await c.read_kv(x) for x in (a, b)])
            return got

    got = asyncio.run(main())
    with karakv.Client.attach(daemon.target) as c:
        a, b = c.create_sequence(), c.create_sequence()
        c.append(a, k1, v1), c.append(b, k2, v2), c.append(a, k2, v2)
        want = [c.read_kv(x) for x in (a, b)]
    for caches in got:
        for got_seq, want_seq in zip(caches, want):
            for g, w in zip(got_seq, want_seq):
                np.testing.assert_array_equal(g, w)
