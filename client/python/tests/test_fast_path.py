"""The fast path (attach(fast_path=True)): Step, Attend, Append and ReadKV through the shared-memory
command ring, as the daemon counts them, with the same errors as over gRPC, and what happens when the
ring's session ends or the daemon restarts. test_against_cpp.py checks its outputs byte for byte."""
import math
import re
import time

import numpy as np
import pytest

import karakv
from conftest import free_port, metric

L, HQ, HK, D = 2, 4, 2, 16  # conftest.GEOMETRY


def kv(tokens, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((L, tokens, HK, D)).astype(np.float16),
            rng.standard_normal((L, tokens, HK, D)).astype(np.float16))


def step_inputs(batch, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, HK, D)).astype(np.float16),
            rng.standard_normal((batch, HK, D)).astype(np.float16),
            rng.standard_normal((batch, HQ, D), dtype=np.float32))


def ring_count(port, method):
    return metric(port, f'karakv_decode_commands_total{{method="{method}",path="ring"}}')


def test_steps_attends_appends_and_read_kv_go_through_the_ring(start_daemon):
    port = free_port()
    d = start_daemon("--pool_bytes=4MiB", f"--metrics_listen=127.0.0.1:{port}")
    with karakv.Client.attach(d.target, fast_path=True) as fast, karakv.Client.attach(d.target) as plain:
        assert fast.fast_path and not plain.fast_path
        a, b = fast.create_sequence(), plain.create_sequence()
        k, v = kv(9)
        fast.append(a, k, v)
        plain.append(b, k, v)
        for layer in range(L):
            inputs = step_inputs(1, seed=layer)
            np.testing.assert_array_equal(fast.step(layer, [a], *inputs), plain.step(layer, [b], *inputs))
        assert fast.last_decode_step > 0
        q = np.random.default_rng(5).standard_normal((3, HQ, D), dtype=np.float32)
        np.testing.assert_array_equal(fast.attend(a, 1, q), plain.attend(b, 1, q))
        for got, want in zip(fast.read_kv(a), plain.read_kv(b)):
            np.testing.assert_array_equal(got, want)
        ring_k, _, _ = fast.read_kv(a)
        np.testing.assert_array_equal(ring_k[:, :9], k)  # the prompt as appended
        # An Append with token ids copies them into staging too and takes the ring; the daemon gets
        # them (the prompt's whole blocks are published: a lookup finds them).
        c = fast.create_sequence()
        calls = fast.ring_calls
        prompt = list(range(500, 509))  # 2 whole blocks of 4, and one more token
        fast.append(c, *kv(9, seed=2), token_ids=np.array(prompt, np.int64))
        assert fast.ring_calls == calls + 1
        assert plain.lookup(prompt) == 8
        fast.append(a, *kv(2), token_ids=[7, 8])
        assert fast.ring_calls == 1 + L + 1 + 2 + 2 and plain.ring_calls == 0
    assert ring_count(port, "Step") == L and ring_count(port, "Attend") == 1
    assert metric(port, 'karakv_decode_commands_total{method="Step",path="grpc"}') == L


def test_ring_errors_equal_grpc_errors(daemon):
    with karakv.Client.attach(daemon.target, fast_path=True) as fast, karakv.Client.attach(daemon.target) as plain:
        seqs = {}
        for c in (fast, plain):
            seqs[c] = c.create_sequence()
            c.append(seqs[c], *kv(5))
        bad_calls = [
            lambda c: c.step(1, [seqs[c]], *step_inputs(1)),                          # layer out of order
            lambda c: c.step(0, [seqs[c]], *step_inputs(1), scale=math.nan),          # NaN scale
            lambda c: c.step(0, [987654], *step_inputs(1)),                           # unknown sequence
            lambda c: c.attend(seqs[c], 7, np.zeros((1, HQ, D), np.float32)),         # no such layer
            lambda c: c.attend(seqs[c], 0, np.zeros((6, HQ, D), np.float32)),         # more queries than tokens
            lambda c: c.append(987654, *kv(2)),                                       # Append: unknown sequence
            lambda c: c.read_kv(987654),                                              # ReadKV: unknown sequence
        ]
        for i, call in enumerate(bad_calls):
            got = {}
            for c in (fast, plain):
                with pytest.raises(karakv.KaraKVError) as e:
                    call(c)
                message = re.sub(r"sequence \d+", "sequence N", e.value.message)
                got[c] = (type(e.value), e.value.code, e.value.method, message)
            assert got[fast] == got[plain], f"bad call {i}"
        assert fast.ring_calls == 1 + len(bad_calls) and fast.fast_path  # the Append, then each refusal


def test_ring_of_an_expired_session_says_not_found(start_daemon):
    d = start_daemon("--pool_bytes=4MiB", "--lease_seconds=1")
    with karakv.Client.attach(d.target, fast_path=True, heartbeat=False) as c:
        seq = c.create_sequence()
        c.append(seq, *kv(3))
        c.step(0, [seq], *step_inputs(1))
        time.sleep(2.5)
        with pytest.raises(karakv.NotFound, match="session"):
            c.step(1, [seq], *step_inputs(1))
        assert not c.fast_path  # karakvd closed the ring with the session


def test_fast_path_after_a_daemon_restart(start_daemon):
    d = start_daemon("--pool_bytes=4MiB")
    with karakv.Client.attach(d.target, fast_path=True) as c:
        seq = c.create_sequence()
        c.append(seq, *kv(3))
        c.step(0, [seq], *step_inputs(1))
        old_instance = c.instance_id
        d.crash_and_restart()
        # The ring of the dead daemon never answers: the liveness check gives it up, and the call's
        # gRPC retry finds the restart and re-attaches; the old sequence is refused.
        with pytest.raises(karakv.DaemonRestarted):
            c.step(1, [seq], *step_inputs(1))
        assert c.instance_id != old_instance
        # The new session has a ring of its own.
        assert c.fast_path and c.ring_calls == 0
        fresh = c.create_sequence()
        c.append(fresh, *kv(3))
        assert c.step(0, [fresh], *step_inputs(1)).shape == (1, HQ, D)
        assert c.ring_calls == 2  # the Append and the Step


def test_fast_path_needs_a_staging_region(daemon):
    with pytest.raises(karakv.InvalidArgument, match=r"fast_path needs a staging region \(staging_bytes > 0\)"):
        karakv.Client.attach(daemon.target, fast_path=True, staging_bytes=0)


def test_append_batch_through_the_ring_grpc_and_inline_is_separate_appends(daemon):
    """append_batch: one ring command on the fast path, one AppendBatch RPC otherwise (staging or
    inline); every path leaves the same caches as separate appends and returns each entry's length."""
    rng = np.random.default_rng(11)
    (k1, v1), (k2, v2), (k3, v3) = kv(3, seed=1), kv(5, seed=2), kv(2, seed=3)
    q2 = rng.standard_normal((L, 2, HQ, D), dtype=np.float32)
    with karakv.Client.attach(daemon.target, fast_path=True) as fast, \
            karakv.Client.attach(daemon.target) as plain, \
            karakv.Client.attach(daemon.target, staging_bytes=0) as inline, \
            karakv.Client.attach(daemon.target) as one_by_one:
        caches = {}
        for c in (fast, plain, inline):
            a, b, s = c.create_sequence(), c.create_sequence(), c.create_sequence()
            c.append(s, *kv(4, seed=9))  # a sequence that is not empty before the batch
            before = c.ring_calls
            lengths = c.append_batch([(a, k1, v1), karakv.AppendEntry(b, k2, v2, q=q2),
                                      {"sequence_id": s, "k": k3, "v": v3}])
            assert lengths == [3, 5, 4 + 2]
            assert c.ring_calls - before == (1 if c is fast else 0)
            caches[c] = [c.read_kv(x) for x in (a, b, s)]
        a, b, s = (one_by_one.create_sequence() for _ in range(3))
        one_by_one.append(s, *kv(4, seed=9))
        assert [one_by_one.append(a, k1, v1), one_by_one.append(b, k2, v2, q=q2), one_by_one.append(s, k3, v3)] \
            == [3, 5, 6]
        want = [one_by_one.read_kv(x) for x in (a, b, s)]
        for c in (fast, plain, inline):
            for got_seq, want_seq in zip(caches[c], want):
                for got, expected in zip(got_seq, want_seq):
                    np.testing.assert_array_equal(got, expected)

        # An entry with token ids has them copied into staging too: the batch still takes the ring.
        x = fast.create_sequence()
        before = fast.ring_calls
        assert fast.append_batch([(x, k1, v1, None, [1, 2, 3]), (x, k3, v3)]) == [3, 5]
        assert fast.ring_calls == before + 1
        # More entries than one ring command holds (50): gRPC, same result.
        many = [fast.create_sequence() for _ in range(karakv._ring.MAX_APPENDS + 1)]
        before = fast.ring_calls
        assert fast.append_batch([(m, k3, v3) for m in many]) == [2] * len(many)
        assert fast.ring_calls == before
        assert fast.append_batch([(m, k3, v3) for m in many[:karakv._ring.MAX_APPENDS]]) \
            == [4] * karakv._ring.MAX_APPENDS
        assert fast.ring_calls == before + 1


def test_append_batch_refusals_name_the_entry_and_keep_the_ones_before(daemon):
    with karakv.Client.attach(daemon.target, fast_path=True) as fast, karakv.Client.attach(daemon.target) as plain:
        got = {}
        for c in (fast, plain):
            a = c.create_sequence()
            with pytest.raises(karakv.NotFound) as e:
                c.append_batch([(a, *kv(2)), (987654, *kv(1))])
            got[c] = (e.value.method, e.value.message)
            assert "entry 1 of 2 (sequence 987654)" in e.value.message
            assert c.read_kv(a)[0].shape[1] == 2  # the entry before the refused one stays applied
            # Checked here before anything is sent: the entry and the argument are named.
            with pytest.raises(karakv.InvalidArgument, match=r"AppendBatch\.entries\[1\]\.v"):
                c.append_batch([(a, *kv(1)), (a, kv(2)[0], kv(3)[1])])
            with pytest.raises(karakv.InvalidArgument, match=r"AppendBatch\.entries\[0\] is int"):
                c.append_batch([a])
            assert c.read_kv(a)[0].shape[1] == 2
        assert got[fast] == got[plain]
