"""KV-cache events (karakvd --kv_events_endpoint) read the way cluster routers read vLLM's: a ZeroMQ
SUB socket decoding [topic, sequence number, msgpack batch] with pyzmq and msgpack, an index of the
announced blocks rebuilt from BlockStored / BlockRemoved / AllBlocksCleared, gaps in the sequence
numbers filled from the replay socket. After a random workload with evictions and compactions, a
subscriber that drops out and replays, and a daemon restart, the index must answer every prompt
exactly as the daemon's Lookup does."""
import os
import random
import sys
import tempfile
import time

import msgpack
import numpy as np
import pytest
import zmq
import zmq.utils.monitor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "client", "python", "tests"))
from conftest import Daemon  # noqa: E402  (the SDK tests' daemon launcher)

import karakv  # noqa: E402

BLOCK = 4
GEOMETRY = ["--layers=2", "--q_heads=2", "--kv_heads=1", "--head_dim=8", "--dtype=fp32", f"--block_size={BLOCK}"]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def decode_event(e):
    """One event, array or "type"-map encoded, as (type, fields)."""
    if isinstance(e, dict):
        return e["type"], e
    kind = e[0]
    if kind == "BlockStored":
        names = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"]
    elif kind == "BlockRemoved":
        names = ["block_hashes", "medium"]
    else:
        names = []
    assert len(e) == 1 + len(names), e
    return kind, dict(zip(names, e[1:]))


class Router:
    """What a KV-aware router keeps: block hash -> (parent hash, token ids), from the events."""

    def __init__(self, endpoint, replay_endpoint):
        self.ctx = zmq.Context.instance()
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.blocks = {}
        self.next_seq = None   # the sequence number expected next
        self.replays = 0
        self.restarts = 0
        self.reconnects = 0
        self.catch_ups = 0
        self.rebuilt = False
        self.kinds = set()
        self.sub = None
        self.connect()

    def connect(self):
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.lost = False
        self.sub.connect(self.endpoint)

    def drop(self):
        self.sub.disable_monitor()
        self.monitor.close(linger=0)
        self.sub.close(linger=0)
        self.sub = None

    def watch_connection(self):
        """A publisher that went away and came back may be a restarted daemon whose first batches
        (its AllBlocksCleared among them) went out before this socket reconnected; its sequence
        numbers may even have passed this one's. So after a reconnection the index is rebuilt from
        the replay buffer's start when that start is batch 0 (every daemon's first batch clears),
        else (a long-running daemon's rolled buffer: a network blip) it goes on from next_seq."""
        while self.monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.lost = True
            elif event == zmq.EVENT_CONNECTED and self.lost:
                self.lost = False
                self.replays += 1
                history = self.replay(0)
                if history and history[0][0] == 0:
                    self.reconnects += 1
                    self.blocks.clear()
                    for s, p in history:
                        self.apply(p)
                    self.next_seq = history[-1][0] + 1
                    self.rebuilt = True

    def apply(self, payload):
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        assert isinstance(batch, list) and len(batch) == 3, batch
        ts, events, rank = batch
        assert isinstance(ts, float) and ts > 1.7e9 and rank is None
        for e in events:
            kind, f = decode_event(e)
            self.kinds.add(kind)
            if kind == "BlockStored":
                assert f["block_size"] == BLOCK and f["lora_id"] is None and f["medium"] == "CPU"
                assert len(f["token_ids"]) == BLOCK * len(f["block_hashes"])
                parent = f["parent_block_hash"]
                for i, h in enumerate(f["block_hashes"]):
                    self.blocks[h] = (parent, tuple(f["token_ids"][i * BLOCK:(i + 1) * BLOCK]))
                    parent = h
            elif kind == "BlockRemoved":
                assert f["medium"] == "CPU"
                for h in f["block_hashes"]:
                    assert h in self.blocks, f"BlockRemoved of {h}, never stored"
                    del self.blocks[h]
            elif kind == "AllBlocksCleared":
                self.blocks.clear()
            else:
                raise AssertionError(f"unknown event {e}")

    def replay(self, start):
        """Every buffered batch from `start` on, from the replay socket, in order."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(5000), "no answer from the replay socket"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                break
            got.append((int.from_bytes(seq, "big"), payload))
        dealer.close(linger=0)
        return got

    def receive(self, seq, payload):
        if self.next_seq is not None and seq < self.next_seq and self.rebuilt:
            return  # queued before the rebuild, which applied it already
        self.rebuilt = False
        if self.next_seq is not None and seq < self.next_seq:
            # A restarted daemon numbers from 0 again; its first batch clears everything.
            self.restarts += 1
            self.next_seq = None
        if self.next_seq is None:
            if seq != 0:
                self.next_seq = 0
            else:
                self.apply(payload)
                self.next_seq = 1
                return
        if seq > self.next_seq:  # missed some: a late join, a slow reader or a dropped socket
            self.replays += 1
            self.apply_replayed(until=seq)
            assert self.next_seq == seq, f"replay ended at {self.next_seq}, the live stream is at {seq}"
        self.apply(payload)
        self.next_seq = seq + 1

    def drain(self, quiet=0.3):
        """Reads until nothing has come for `quiet` seconds, once connected (a subscriber whose
        publisher went away first waits for it to come back: ZeroMQ reconnects on its own)."""
        self.watch_connection()
        deadline = time.monotonic() + 20
        while self.lost and time.monotonic() < deadline:
            self.monitor.poll(100)
            self.watch_connection()
        assert not self.lost, "the subscriber did not reconnect within 20 s"
        while self.sub.poll(int(quiet * 1000)):
            self.watch_connection()
            if not self.sub.poll(0):
                continue
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b"" and len(seq) == 8
            self.receive(int.from_bytes(seq, "big"), payload)
        self.catch_up()

    def catch_up(self):
        """A quiet stream may still have lost its last batches: those published after a (re)connection
        but before the new subscription reached the publisher are dropped, and when the daemon then
        goes idle no later batch shows the gap. So a subscriber that has heard nothing for a while
        asks the replay socket for anything from next_seq on. What it applies here may still be
        queued on the live socket: those copies are skipped like the ones a rebuild applied."""
        self.watch_connection()
        if self.next_seq is None or self.lost:
            return  # nothing to go on from, or a reconnection the next drain waits for
        if self.apply_replayed():
            self.catch_ups += 1
            self.rebuilt = True

    def apply_replayed(self, until=None):
        """Applies the buffered batches from next_seq on (up to `until`), in order; how many."""
        applied = 0
        for s, p in self.replay(self.next_seq):
            if until is not None and s >= until:
                break
            assert s == self.next_seq, f"replay gave {s}, expected {self.next_seq}"
            self.apply(p)
            self.next_seq += 1
            applied += 1
        return applied

    def cached_tokens(self, prompt):
        """The prompt's leading whole blocks the index holds, chained from the first."""
        children = {}
        for h, (parent, tokens) in self.blocks.items():
            children[(parent, tokens)] = h
        parent, n = None, 0
        while n + BLOCK <= len(prompt):
            h = children.get((parent, tuple(prompt[n:n + BLOCK])))
            if h is None:
                break
            parent, n = h, n + BLOCK
        return n


def append_prompt(client, seq, tokens, start):
    t = len(tokens) - start
    if t <= 0:
        return
    rng = np.random.default_rng(start + len(tokens))
    k = rng.standard_normal((2, t, 1, 8), dtype=np.float32)
    v = rng.standard_normal((2, t, 1, 8), dtype=np.float32)
    client.append(seq, k, v, token_ids=tokens[start:])


def workload(client, rng, prompts, steps, live):
    """Random requests: new prompts sharing prefixes with old ones, prefix reuse, releases (whose
    blocks stay cached until evicted), compactions; the small pool forces evictions."""
    for _ in range(steps):
        r = rng.random()
        if r < 0.45 or not prompts:
            base = rng.choice(prompts) if prompts and rng.random() < 0.6 else []
            keep = rng.randrange(0, len(base) + 1) if base else 0
            tokens = base[:keep] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 5 * BLOCK))]
            prompts.append(tokens)
            policy = rng.choice(["none", "none", "streaming"])
            params = {"sinks": 4, "c_max": 16, "c_target": 12} if policy == "streaming" else None
            created = client.create_from_prefix(tokens, policy, params=params)
            append_prompt(client, created.id, tokens, created.cached_tokens)
            live.append(created.id)
        elif r < 0.75 and live:
            client.release(live.pop(rng.randrange(len(live))))
        elif live:
            client.compact(rng.choice(live))
        while len(live) > 6:
            client.release(live.pop(0))


def check(router, client, prompts):
    """The router's index equals the daemon's lookup for every prompt, once the events have arrived.
    The publisher batches on its own thread, which a busy machine may not schedule for longer than a
    drain's quiet time: a mismatch is read again for up to 20 s before it counts (an index that is
    wrong never converges)."""
    deadline = time.monotonic() + 20
    while True:
        router.drain()
        got = [(router.cached_tokens(p), client.lookup(p)) for p in prompts]
        if all(a == b for a, b in got) or time.monotonic() > deadline:
            break
    for p, (indexed, looked_up) in zip(prompts, got):
        assert indexed == looked_up, p
    return sum(1 for _, looked_up in got if looked_up > 0)


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_router_index_equals_lookup(encoding):
    binary = os.environ.get("KARAKVD")
    if not binary or not os.access(binary, os.X_OK):
        pytest.skip("KARAKVD is not set to the karakvd binary (ctest sets it)")
    with tempfile.TemporaryDirectory(prefix="karakv-ev-") as work:
        ev, rp = f"ipc://{work}/events", f"ipc://{work}/replay"
        flags = [*GEOMETRY, "--pool_bytes=64KiB", f"--kv_events_endpoint={ev}", f"--kv_events_replay_endpoint={rp}",
                 f"--kv_events_encoding={encoding}"]
        daemon = Daemon(binary, flags, work)
        try:
            router = Router(ev, rp)
            client = karakv.Client.attach(daemon.target, staging_bytes=0)
            rng = random.Random(7)
            prompts, live = [], []
            evicted_before = 0
            for round_ in range(4):
                workload(client, rng, prompts, 40, live)
                hits = check(router, client, prompts)
                assert hits > 0, "the workload shares no prefix: it tests nothing"
                if round_ == 1:
                    # A subscriber that drops out misses batches, then replays them.
                    router.drop()
                    workload(client, rng, prompts, 30, live)
                    router.connect()
                    time.sleep(0.2)  # the new SUB socket's subscription reaches the publisher
                    workload(client, rng, prompts, 5, live)
                    check(router, client, prompts)
            # (a gap seen in the live stream, or the tail caught up after it went quiet)
            assert router.replays + router.catch_ups > 0, "the subscriber that dropped out replayed nothing"
            stats = client.stats()
            assert stats.prefix_evictions > evicted_before, "no eviction: the pool is too large to test them"
            assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= router.kinds
            client.close()

            # A restarted daemon holds nothing and numbers its batches from 0 again, the first one
            # AllBlocksCleared. A subscriber learns of it from its next batch (the restart's first
            # one is usually published before the subscriber has reconnected): a sequence number
            # below the expected one is a restart, and the replay from 0 brings the clearing.
            daemon.stop()
            daemon = Daemon(binary, flags, work)
            client = karakv.Client.attach(daemon.target, staging_bytes=0)
            live = []
            workload(client, rng, prompts, 40, live)
            assert check(router, client, prompts) > 0
            assert router.restarts + router.reconnects >= 1
            client.close()
        finally:
            daemon.stop()


def test_bad_endpoints_are_refused():
    binary = os.environ.get("KARAKVD")
    if not binary or not os.access(binary, os.X_OK):
        pytest.skip("KARAKVD is not set to the karakvd binary (ctest sets it)")
    import subprocess
    for flags, message in [
        (["--kv_events_endpoint=nonsense://x"], "--kv_events_endpoint=nonsense://x: cannot bind"),
        (["--kv_events_replay_endpoint=tcp://127.0.0.1:1"], "replays the events of --kv_events_endpoint, which is empty"),
        (["--kv_events_endpoint=tcp://127.0.0.1:0", "--kv_events_encoding=json"], "expected array or map"),
    ]:
        r = subprocess.run([binary, "--socket=", "--listen_tcp=127.0.0.1:0", *GEOMETRY, "--pool_bytes=64KiB", *flags],
                           capture_output=True, text=True, timeout=20)
        assert r.returncode != 0 and message in r.stderr, (flags, r.returncode, r.stderr)
