"""Typed errors mapped from the daemon's status codes, the lease and heartbeat, staging handling
(unlinked name, zero-copy arrays, full region), and the no-trace rule after a refused request."""
import os
import time

import grpc
import numpy as np
import pytest

import karakv
from conftest import GEOMETRY

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


def test_attach_reports_geometry_and_unlinks_staging(daemon):
    with karakv.Client.attach(daemon.target, staging_bytes=1 << 20) as c:
        assert c.geometry == karakv.Geometry(L, HQ, HK, D, "fp16", 4)
        assert c.staging_name.startswith("/karakv-")
        # Mapped by both sides, then unlinked: no other process can open it by name.
        assert not os.path.exists("/dev/shm/" + c.staging_name.lstrip("/"))
        assert c.stats().sessions == 1
    assert karakv.health(daemon.target) == "SERVING"


def test_not_found_carries_the_daemons_message(daemon):
    with karakv.Client.attach(daemon.target) as c:
        with pytest.raises(karakv.NotFound) as e:
            c.release(987654)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert e.value.method == "ReleaseSequence"
    assert "unknown sequence 987654" in e.value.message
    assert isinstance(e.value, karakv.KaraKVError)


def test_invalid_argument_geometry_and_policy(daemon):
    wrong = karakv.Geometry(L, HQ, HK, 32, "fp16", 4)
    with pytest.raises(karakv.InvalidArgument, match="geometry"):
        karakv.Client.attach(daemon.target, geometry=wrong)
    with karakv.Client.attach(daemon.target, geometry=karakv.Geometry(L, HQ, HK, D, "fp16", 4)) as c:
        with pytest.raises(karakv.InvalidArgument, match="nosuchpolicy"):
            c.create_sequence("nosuchpolicy")
        with pytest.raises(karakv.InvalidArgument, match="rho"):
            c.create_sequence("kara", params={"rho": 7})


def test_permission_denied_for_another_tenants_sequence(daemon):
    with karakv.Client.attach(daemon.target, tenant="a") as a, \
            karakv.Client.attach(daemon.target, tenant="b") as b:
        seq = a.create_sequence()
        with pytest.raises(karakv.PermissionDenied) as e:
            b.append(seq, *kv(3))
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert a.append(seq, *kv(3)) == 3


def test_failed_precondition_for_a_step_out_of_order(daemon):
    with karakv.Client.attach(daemon.target) as c:
        seq = c.create_sequence()
        c.append(seq, *kv(5))
        with pytest.raises(karakv.FailedPrecondition, match="starts at layer 0, got layer 1"):
            c.step(1, [seq], *step_inputs(1))


def test_resource_exhausted_pool_full_leaves_no_trace(start_daemon):
    # 4-token blocks of 2 layers x 2 KV heads x 16 dims x K,V x fp16 = 1 KiB: 16 KiB = 16 blocks.
    d = start_daemon("--pool_bytes=16KiB")
    with karakv.Client.attach(d.target) as c:
        seq = c.create_sequence()
        assert c.append(seq, *kv(60)) == 60  # 15 blocks
        with pytest.raises(karakv.ResourceExhausted) as e:
            c.append(seq, *kv(8))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "free" in e.value.message
        s = c.stats(check_invariants=True)
        assert (s.blocks_used, s.resident_tokens, s.invariant_error) == (15, 60, "")
        assert c.list_sequences()[0].length == 60


def test_unavailable_when_no_daemon(tmp_path):
    with pytest.raises(karakv.Unavailable):
        karakv.Client.attach("unix:" + str(tmp_path / "nobody.sock"), rpc_timeout=2)


def test_client_side_checks(daemon):
    with karakv.Client.attach(daemon.target, staging_bytes=4096) as c:
        seq = c.create_sequence()
        with pytest.raises(karakv.InvalidArgument, match=r"expected \[L\]\[T\]\[Hk\]\[D\]"):
            c.append(seq, np.zeros((L, 3, HK, D + 1), np.float16), np.zeros((L, 3, HK, D + 1), np.float16))
        with pytest.raises(karakv.InvalidArgument, match="int64"):
            c.append(seq, np.zeros((L, 3, HK, D), np.int64), np.zeros((L, 3, HK, D), np.int64))
        # 2 x 2 layers x 40 tokens x 2 heads x 16 dims x 2 bytes > 4096: the region is too small.
        with pytest.raises(karakv.ResourceExhausted, match="staging region full"):
            c.append(seq, *kv(40))
        assert c.list_sequences()[0].length == 0


def test_zero_copy_arrays_and_out_match_copied_path(daemon):
    with karakv.Client.attach(daemon.target) as c:
        a, b = c.create_sequence(), c.create_sequence()
        k, v = kv(9)
        c.append(a, k, v)
        sk, sv = c.alloc(k.shape, np.float16), c.alloc(v.shape, np.float16)
        sk[...], sv[...] = k, v
        c.append(b, sk, sv)
        for layer in range(L):
            k1, v1, q1 = step_inputs(1, seed=layer)
            want = c.step(layer, [a], k1, v1, q1)
            sq, out = c.alloc(q1.shape), c.alloc(q1.shape)
            sq[...] = q1
            got = c.step(layer, [b], k1, v1, sq, out=out)
            assert got is out
            np.testing.assert_array_equal(out, want)
        ka, va, pa = c.read_kv(a)
        kb, vb, pb = c.read_kv(b)
        assert ka.shape == (L, 10, HK, D) and pa.shape == (L, HK, 10)
        np.testing.assert_array_equal(ka, kb)
        np.testing.assert_array_equal(va, vb)
        np.testing.assert_array_equal(pa[0, 0], np.arange(10))
        np.testing.assert_array_equal(ka[:, :9], k)
        c.reset_staging()
        with pytest.raises(karakv.ResourceExhausted):
            c.alloc((c.staging_bytes + 1,), np.uint8)


def test_fork_shares_blocks_and_release_frees_them(daemon):
    with karakv.Client.attach(daemon.target) as c:
        parent = c.create_sequence()
        c.append(parent, *kv(8))  # 2 full blocks
        child = c.fork(parent)
        infos = {s.sequence_id: s for s in c.list_sequences()}
        assert infos[child].shared_blocks == 2 and infos[child].length == 8
        assert c.release(child) == 0  # shared blocks stay with the parent
        assert c.release(parent) == 2
        assert c.stats().blocks_used == 0


def test_heartbeat_keeps_the_lease_and_silence_loses_it(start_daemon):
    d = start_daemon("--pool_bytes=4MiB", "--lease_seconds=1")
    with karakv.Client.attach(d.target, heartbeat=True) as alive, \
            karakv.Client.attach(d.target, heartbeat=False) as silent:
        assert alive.lease_seconds == 1
        seq = silent.create_sequence()
        time.sleep(2.5)
        alive.create_sequence()
        with pytest.raises(karakv.NotFound, match="session"):
            silent.append(seq, *kv(1))
        assert alive.stats().lease_expiries == 1


def test_detach_frees_the_session(daemon):
    c = karakv.Client.attach(daemon.target)
    c.create_sequence()
    c.create_sequence()
    assert c.detach() == 2
    with pytest.raises(karakv.NotFound):
        c.create_sequence()
    c.close()
    with karakv.Client.attach(daemon.target) as other:
        assert other.stats().sequences == 0


def test_bf16_storage_rounds_to_nearest_even(start_daemon):
    geometry = [a.replace("fp16", "bf16") for a in GEOMETRY]
    d = start_daemon("--pool_bytes=4MiB", geometry=geometry)
    with karakv.Client.attach(d.target) as c:
        assert c.geometry.dtype == "bf16"
        seq = c.create_sequence()
        k = np.full((L, 2, HK, D), 1.0, np.float32)
        k[:, 0] = 1 + 2.0 ** -8       # half an ulp above 1.0: ties to even, 1.0 (0x3f80)
        k[:, 1] = 1 + 3 * 2.0 ** -8   # 1.5 ulp: ties to even, 1 + 2 ulp (0x3f82)
        v = np.arange(L * 2 * HK * D, dtype=np.float32).reshape(k.shape)  # integers < 256: exact
        c.append(seq, k, v)
        rk, rv, _ = c.read_kv(seq)
        assert rk.dtype == np.uint16
        assert (rk[:, 0] == 0x3F80).all() and (rk[:, 1] == 0x3F82).all()
        np.testing.assert_array_equal((rv.astype(np.uint32) << 16).view(np.float32), v)
        # uint16 bit patterns go through unchanged.
        c.append(seq, rk[:, :1], rv[:, :1])
        rk2, _, _ = c.read_kv(seq)
        np.testing.assert_array_equal(rk2[:, 2], rk[:, 0])


def test_compact_dry_run_changes_nothing_then_compacts(daemon):
    with karakv.Client.attach(daemon.target) as c:
        seq = c.create_sequence("streaming", params={"c_max": 24, "c_target": 12, "sinks": 2})
        c.append(seq, *kv(20))
        (dry,) = c.compact(seq, dry_run=True)
        assert (dry.sequence_id, dry.policy, dry.tokens_before, dry.tokens_after) == (seq, "streaming", 20, 12)
        # StreamingLLM keeps the sinks and the newest tokens, in every (layer, KV head) row.
        assert dry.kept == [[0, 1] + list(range(10, 20))] * (L * HK)
        assert c.list_sequences()[0].length == 20
        (done,) = c.compact(seq)
        assert done.tokens_after == 12 and done.kept == []
        _, _, positions = c.read_kv(seq)
        np.testing.assert_array_equal(positions[1, 1], [0, 1] + list(range(10, 20)))


def test_restart_is_a_typed_error_and_reattach_gives_a_working_session(start_daemon):
    d = start_daemon("--pool_bytes=4MiB")
    with karakv.Client.attach(d.target, staging_bytes=1 << 20, auto_reattach=False) as c:
        old_instance, old_session = c.instance_id, c.session_id
        assert len(old_instance) == 32
        seq = c.create_sequence()
        k, v = kv(9)
        c.append(seq, k, v)
        d.crash_and_restart()
        # Every call on the old session says the daemon restarted, never returns data.
        with pytest.raises(karakv.DaemonRestarted) as e:
            c.read_kv(seq)
        assert "the daemon restarted; re-prefill" in e.value.message
        assert e.value.code == grpc.StatusCode.ABORTED and e.value.method == "ReadKV"
        assert isinstance(e.value, karakv.Aborted)
        with pytest.raises(karakv.DaemonRestarted):
            c.append(seq, k, v)
        c.reattach()
        assert c.instance_id != old_instance and c.session_id != old_session
        assert c.stats().sessions == 1 and c.list_sequences() == []
        seq2 = c.create_sequence()
        assert c.append(seq2, k, v) == 9
        rk, rv, pos = c.read_kv(seq2)
        np.testing.assert_array_equal(rk, k)
        np.testing.assert_array_equal(np.asarray(pos).reshape(-1)[:9], np.arange(9))


def test_auto_reattach_refuses_lost_sequences_and_repeats_other_calls(start_daemon):
    d = start_daemon("--pool_bytes=4MiB")
    with karakv.Client.attach(d.target, staging_bytes=1 << 20) as c:
        old_instance, old_session = c.instance_id, c.session_id
        lost = [c.create_sequence() for _ in range(3)]
        k, v = kv(9)
        for seq in lost:
            c.append(seq, k, v)
        buf = c.alloc(k.shape, np.float16)  # an array in the old staging region
        buf[:] = k
        d.crash_and_restart()
        # The first call names no sequence: the client re-attaches and repeats it on the new session.
        assert c.list_sequences() == []
        assert c.instance_id != old_instance and c.session_id != old_session
        assert c.stats().sessions == 1
        # Every old sequence is refused with the typed error, before any RPC could read new data.
        for seq in lost:
            with pytest.raises(karakv.DaemonRestarted) as e:
                c.read_kv(seq)
            assert "the daemon restarted; re-prefill" in e.value.message and str(seq) in e.value.message
            assert e.value.code == grpc.StatusCode.ABORTED
        with pytest.raises(karakv.DaemonRestarted):
            c.step(0, [lost[0]], *step_inputs(1))
        # New sequences never reuse an old id (the new daemon numbers from the start again).
        fresh = [c.create_sequence() for _ in range(4)]
        assert not set(fresh) & set(lost)
        assert c.append(fresh[0], k, v) == 9
        rk, _, _ = c.read_kv(fresh[0])
        np.testing.assert_array_equal(rk, k)
        # The old staging array is still readable and still usable as input (sent inline now).
        np.testing.assert_array_equal(buf, k)
        assert c.append(fresh[1], buf, v) == 9
        np.testing.assert_array_equal(c.read_kv(fresh[1])[0], k)
        assert c.stats(check_invariants=True).sequences == len(fresh)


def test_an_expired_lease_stays_not_found(start_daemon):
    d = start_daemon("--pool_bytes=4MiB", "--lease_seconds=1")
    with karakv.Client.attach(d.target, heartbeat=False) as c:
        time.sleep(2.5)
        with pytest.raises(karakv.NotFound) as e:
            c.create_sequence()
        assert not isinstance(e.value, karakv.DaemonRestarted)


def test_every_event_kind_of_the_proto_maps_to_an_event():
    # A failed compaction (a kernel's error naming its op) comes through with its sequence, policy
    # and reason; a kind this SDK does not know would be skipped (None), so each the proto has must map.
    from karakv.client import _event
    from karakv.v1 import karakv_pb2 as pb
    e = pb.Event(number=3, time_unix=1.5)
    e.compaction_failed.sequence_id = 7
    e.compaction_failed.policy = "kara"
    e.compaction_failed.reason = "INTERNAL: gather_tokens: device fault"
    out = _event(e)
    assert (out.kind, out.number, out.sequence_id, out.policy, out.reason) == (
        "compaction_failed", 3, 7, "kara", "INTERNAL: gather_tokens: device fault")
    for kind in pb.Event.DESCRIPTOR.oneofs_by_name["kind"].fields:
        e = pb.Event()
        getattr(e, kind.name).SetInParent()
        assert _event(e) is not None and _event(e).kind == kind.name, kind.name
