"""What the Python SDK has in common with the C++ SDK beyond the decode calls: status code names in
errors, $KARAKV_TARGET, the prefix cache (Lookup, creation from a prefix, appends with token ids),
Inspect, the event stream, and arrays that are views of the staging region."""
import threading

import grpc
import numpy as np
import pytest

import karakv

L, HQ, HK, D, BLOCK = 2, 4, 2, 16, 4  # conftest.GEOMETRY


def kv(tokens, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((L, tokens, HK, D)).astype(np.float16),
            rng.standard_normal((L, tokens, HK, D)).astype(np.float16))


def test_errors_name_their_status_code(daemon):
    with karakv.Client.attach(daemon.target) as c:
        with pytest.raises(karakv.NotFound) as e:
            c.release(987654)
    assert str(e.value).startswith("NOT_FOUND: ReleaseSequence: unknown sequence 987654")
    assert e.value.code_name == "NOT_FOUND"
    # Checks the SDK makes itself read the same way.
    with karakv.Client.attach(daemon.target) as c:
        with pytest.raises(karakv.InvalidArgument) as e:
            c.append(c.create_sequence(), np.zeros((L, 1, HK, D + 1), np.float16),
                     np.zeros((L, 1, HK, D + 1), np.float16))
    assert str(e.value).startswith("INVALID_ARGUMENT: Append.k: Append.k has shape")


def test_karakv_target_is_the_default_target(daemon, monkeypatch, tmp_path):
    monkeypatch.setenv("KARAKV_TARGET", daemon.target)
    assert karakv.default_target() == daemon.target
    assert karakv.health() == "SERVING"
    with karakv.Client.attach() as c:
        assert c.target == daemon.target
        c.create_sequence()
        assert c.stats().sequences == 1
    # An explicit target wins over the environment.
    nobody = "unix:" + str(tmp_path / "nobody.sock")
    with pytest.raises(karakv.Unavailable):
        karakv.Client.attach(nobody, rpc_timeout=2)
    monkeypatch.setenv("KARAKV_TARGET", "")
    assert karakv.default_target() == "unix:/tmp/karakv.sock"


def test_model_fingerprint_scopes_cached_prompts_and_is_checked(daemon):
    prompt = list(range(300, 310))
    k, v = kv(10, seed=4)
    with karakv.Client.attach(daemon.target, model_fingerprint="smol-135m@r1") as a:
        seq = a.create_sequence()
        assert a.append(seq, k, v, token_ids=np.array(prompt, np.int32)) == 10
        assert a.lookup(prompt) == 8
        # The same model in another session shares them; another model or none does not.
        with karakv.Client.attach(daemon.target, model_fingerprint="smol-135m@r1") as same:
            assert same.lookup(prompt) == 8
        with karakv.Client.attach(daemon.target, model_fingerprint="smol-360m@r1") as other:
            assert other.lookup(prompt) == 0
        with karakv.Client.attach(daemon.target) as none:
            assert none.lookup(prompt) == 0
    with pytest.raises(karakv.InvalidArgument, match="model_fingerprint of 9 bytes refused"):
        karakv.Client.attach(daemon.target, model_fingerprint="has space")


def test_prefix_cache_lookup_and_create_from_prefix(daemon):
    prompt = list(range(100, 110))  # 10 tokens: 2 whole blocks of 4, then 2 more
    k, v = kv(10, seed=3)
    with karakv.Client.attach(daemon.target) as a:
        assert a.lookup(prompt) == 0
        first = a.create_sequence()
        assert a.append(first, k, v, token_ids=np.array(prompt, np.int32)) == 10
        assert a.lookup(prompt) == 8
        assert a.lookup(prompt[:7]) == 4
        assert a.lookup([1, 2, 3, 4, 5]) == 0
        created = a.create_from_prefix(prompt, "none")
        assert isinstance(created, karakv.CreatedSequence) and created.cached_tokens == 8
        # The rest of the prompt from token cached_tokens on, with its ids.
        assert a.append(created.id, k[:, 8:], v[:, 8:], token_ids=prompt[8:]) == 10
        rk, rv, _ = a.read_kv(created.id)
        np.testing.assert_array_equal(rk, k)
        np.testing.assert_array_equal(rv, v)
        infos = {s.sequence_id: s for s in a.list_sequences()}
        assert infos[created.id].shared_blocks == 2
        s = a.stats()
        assert s.prefix_cache_enabled and s.prefix_hit_tokens == 8 + 4 + 8
        # Another tenant has its own namespace: nothing cached for it.
        with karakv.Client.attach(daemon.target, tenant="other") as b:
            assert b.lookup(prompt) == 0
            assert b.create_from_prefix(prompt).cached_tokens == 0
        with pytest.raises(karakv.InvalidArgument, match="expected T = 2"):
            a.append(created.id, k[:, :2], v[:, :2], token_ids=[1, 2, 3])
        with pytest.raises(karakv.InvalidArgument, match="1-D sequence of integer token ids"):
            a.lookup(np.zeros((2, 2), np.int32))


def test_shared_cache_namespace_needs_the_daemons_permission(daemon):
    with pytest.raises(karakv.PermissionDenied, match="prefix_cache_shared_namespaces"):
        karakv.Client.attach(daemon.target, cache_namespace="team")


def test_inspect_shows_any_sequences_positions(daemon):
    with karakv.Client.attach(daemon.target) as c, karakv.Client.attach(daemon.target) as operator:
        seq = c.create_sequence("streaming", params={"c_max": 24, "c_target": 12, "sinks": 2})
        c.append(seq, *kv(20))
        c.compact(seq)
        seen = operator.inspect(seq)  # another session: Inspect needs none
        assert seen.info.sequence_id == seq and seen.info.policy == "streaming" and seen.info.length == 12
        assert seen.info.tenant == "default" and seen.info.session_id != c.session_id  # the operator view hides it
        assert seen.positions == [[0, 1] + list(range(10, 20))] * (L * HK)
        with pytest.raises(karakv.NotFound, match="424242"):
            operator.inspect(424242)


def test_event_stream_compaction_and_session_end(daemon):
    c = karakv.Client.attach(daemon.target)
    stream = c.watch_events()
    seq = c.create_sequence("streaming", params={"c_max": 24, "c_target": 12, "sinks": 2})
    c.append(seq, *kv(20))
    c.compact(seq, dry_run=True)  # a dry run is no event
    c.compact(seq)
    e = next(stream)
    assert (e.kind, e.number, e.sequence_id, e.policy, e.tokens_before, e.tokens_after) == \
        ("compaction", 1, seq, "streaming", 20, 12)
    assert e.time_unix > 0
    c.detach()
    e = next(stream)
    assert (e.kind, e.number, e.lease_expired, e.sequences_released) == ("session_ended", 2, False, 1)
    assert list(stream) == []
    assert stream.finish() is None
    # A stream of a session that no longer exists is refused, with the daemon's reason.
    with pytest.raises(karakv.NotFound, match="unknown session"):
        c.watch_events()
    c.close()


def test_event_stream_tells_of_a_preemption(start_daemon):
    # 4 KiB pool = 4 blocks of 4 tokens (2 layers x 2 KV heads x 16 dims x K,V x fp16 = 1 KiB each).
    d = start_daemon("--pool_bytes=4KiB", "--preempt_on_pressure")
    with karakv.Client.attach(d.target) as low_owner, karakv.Client.attach(d.target) as high_owner:
        with low_owner.watch_events() as stream:
            low = low_owner.create_sequence(priority=0)
            low_owner.append(low, *kv(12))  # 3 blocks
            high = high_owner.create_sequence(priority=5)
            assert high_owner.append(high, *kv(8)) == 8  # wants 2, 1 free: preempts `low`
            e = next(stream)
            assert (e.kind, e.sequence_id, e.priority, e.blocks_freed, e.tokens_lost) == \
                ("preempted", low, 0, 3, 12)
            assert f"sequence {low} (priority 0) was preempted" in e.reason
            with pytest.raises(karakv.FailedPrecondition, match="was preempted"):
                low_owner.append(low, *kv(1))


def test_event_stream_cancel_from_another_thread(daemon):
    with karakv.Client.attach(daemon.target) as c:
        stream = c.watch_events()
        got = []
        reader = threading.Thread(target=lambda: got.extend(stream))
        reader.start()
        stream.cancel()
        reader.join(10)
        assert not reader.is_alive() and got == []
        err = stream.finish()
        assert isinstance(err, karakv.Cancelled) and err.code == grpc.StatusCode.CANCELLED


def test_alloc_arrays_are_views_of_the_staging_region(daemon):
    # The region (two pages) holds exactly k, v of 30 tokens (2 x 3840 B) and q, out of one query
    # (2 x 256 B): with any copy of an input into the scratch area the calls below could not fit.
    kv_bytes = L * 30 * HK * D * 2
    q_bytes = 1 * HQ * D * 4
    with karakv.Client.attach(daemon.target, staging_bytes=2 * kv_bytes + 2 * q_bytes) as c:
        assert c.staging_bytes == 2 * kv_bytes + 2 * q_bytes == 8192
        k, v = c.alloc((L, 30, HK, D), np.float16), c.alloc((L, 30, HK, D), np.float16)
        q, out = c.alloc((1, HQ, D)), c.alloc((1, HQ, D))
        k[...], v[...] = kv(30)
        seq = c.create_sequence()
        assert c.append(seq, k, v) == 30
        # A write into the array after the call is what the next call reads: no snapshot was taken.
        q[...] = 1.0
        got = c.attend(seq, 0, q, out=out)
        assert got is out and np.shares_memory(out, c._staging.bytes)
        want = out.copy()
        out[...] = 0
        v[...] = 0  # the cache holds its own copy of the values, so the result stays
        np.testing.assert_array_equal(c.attend(seq, 0, q, out=out), want)
        with pytest.raises(karakv.ResourceExhausted, match="staging region full"):
            c.attend(seq, 0, np.ones((1, HQ, D), np.float32), out=out)  # q is not in staging: no room
