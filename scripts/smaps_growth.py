#!/usr/bin/env python3
"""Where a running process's resident memory grows, mapping by mapping.

    scripts/smaps_growth.py record PID OUT.jsonl [--every S] [--for S]
    scripts/smaps_growth.py diff OUT.jsonl T1_S T2_S [--top N]

`record` reads /proc/PID/smaps every S seconds (default 10) until the process ends or S seconds
pass, and appends one JSON line per snapshot: the time, the thread count and, per mapping, its
range, permissions, path and resident / anonymous / shared-memory KiB. `diff` takes the snapshots
nearest to T1 and T2 and prints the growth by kind of mapping (the main heap, malloc's per-thread
arena heaps, thread stacks, other anonymous memory, shared memory, each file's pages) and the
mappings that grew most. A mapping absent at T1 counts as new, one absent at T2 as gone.

Kinds are inferred from what smaps shows: an anonymous read-write mapping right above a no-access
one is a thread stack (glibc puts the guard page below the stack, in one mapping with it); an
anonymous read-write mapping that starts on a 64 MiB boundary and is followed by the no-access
rest of it (or fills all 64 MiB) is the used head of a malloc arena heap (glibc maps those
64 MiB-aligned, no-access, and opens them up as the arena grows).
"""
import argparse
import collections
import json
import os
import sys
import time

ARENA_ALIGN = 64 << 20


def read_smaps(pid):
    maps, cur = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if "-" in parts[0] and not parts[0].endswith(":"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                cur = {"lo": lo, "hi": hi, "perms": parts[1], "path": " ".join(parts[5:]) if len(parts) > 5 else "",
                       "rss": 0, "anon": 0, "shmem": 0}
                maps.append(cur)
            elif cur is not None and parts[0] == "Rss:":
                cur["rss"] = int(parts[1])
            elif cur is not None and parts[0] == "Anonymous:":
                cur["anon"] = int(parts[1])
            elif cur is not None and parts[0] in ("Shared_Dirty:",) and cur["path"].startswith("/dev/shm"):
                cur["shmem"] += int(parts[1])
    return maps


def record(args):
    t0 = time.monotonic()
    with open(args.out, "a") as out:
        while time.monotonic() - t0 <= args.duration:
            try:
                maps = read_smaps(args.pid)
                threads = len(os.listdir(f"/proc/{args.pid}/task"))
            except (FileNotFoundError, ProcessLookupError):
                break
            out.write(json.dumps({"t": round(time.monotonic() - t0, 1), "threads": threads, "maps": maps}) + "\n")
            out.flush()
            time.sleep(args.every)


def classify(m, prev, nxt=None):
    size_kib = (m["hi"] - m["lo"]) // 1024
    path = m["path"]
    if path == "[heap]":
        return "main heap"
    if path.startswith("[") and path != "":
        return path
    if path.startswith("/dev/shm") or "SYSV" in path or "memfd:" in path:
        return "shared memory"
    if path:
        return "file " + os.path.basename(path.split(" (deleted)")[0])
    if "w" not in m["perms"]:
        return "anonymous, no access"
    guard_below = prev is not None and prev["hi"] == m["lo"] and prev["perms"].startswith("---")
    if guard_below and size_kib >= 64:
        return "thread stacks"
    rest_closed = nxt is not None and nxt["lo"] == m["hi"] and nxt["perms"].startswith("---") and not nxt["path"]
    if m["lo"] % ARENA_ALIGN == 0 and (rest_closed or m["hi"] - m["lo"] == ARENA_ALIGN):
        return "malloc arena heaps"
    return "other anonymous"


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def nearest(snaps, t):
    return min(snaps, key=lambda s: abs(s["t"] - t))


def by_kind(snap):
    kinds = collections.Counter()
    maps = sorted(snap["maps"], key=lambda m: m["lo"])
    for i, m in enumerate(maps):
        kinds[classify(m, maps[i - 1] if i else None, maps[i + 1] if i + 1 < len(maps) else None)] += m["rss"]
    return kinds


def diff(args):
    snaps = load(args.recording)
    if not snaps:
        sys.exit(f"smaps_growth: {args.recording} holds no snapshot")
    a, b = nearest(snaps, args.t1), nearest(snaps, args.t2)
    ka, kb = by_kind(a), by_kind(b)
    total_a, total_b = sum(m["rss"] for m in a["maps"]), sum(m["rss"] for m in b["maps"])
    print(f"snapshots at {a['t']} s and {b['t']} s; threads {a['threads']} -> {b['threads']}")
    print(f"resident {total_a} -> {total_b} KiB ({total_b - total_a:+d})")
    print(f"{'kind':<32} {'t1 KiB':>9} {'t2 KiB':>9} {'change':>8}")
    same = 0
    for kind in sorted(set(ka) | set(kb), key=lambda k: -(kb[k] - ka[k])):
        if ka[kind] != kb[kind]:
            print(f"{kind:<32} {ka[kind]:>9} {kb[kind]:>9} {kb[kind] - ka[kind]:>+8}")
        else:
            same += 1
    print(f"({same} other kinds unchanged)")
    key = lambda m: (m["lo"], m["path"])
    ma = {key(m): m for m in a["maps"]}
    mb = {key(m): m for m in b["maps"]}
    changes = []
    for k in set(ma) | set(mb):
        ra = ma[k]["rss"] if k in ma else 0
        rb = mb[k]["rss"] if k in mb else 0
        if ra != rb:
            m = mb.get(k) or ma[k]
            state = "new" if k not in ma else ("gone" if k not in mb else "")
            changes.append((rb - ra, m, state, ra, rb))
    changes.sort(key=lambda c: -abs(c[0]))
    print(f"\nmappings that changed most (of {len(changes)}):")
    for delta, m, state, ra, rb in changes[: args.top]:
        print(f"  {m['lo']:012x}-{m['hi']:012x} {m['perms']} {(m['hi'] - m['lo']) // 1024:>7} KiB "
              f"{ra:>6} -> {rb:>6} ({delta:+d}) {state:<4} {m['path']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="snapshot /proc/PID/smaps periodically")
    r.add_argument("pid", type=int)
    r.add_argument("out")
    r.add_argument("--every", type=float, default=10, help="seconds between snapshots")
    r.add_argument("--for", dest="duration", type=float, default=3600, help="seconds to record at most")
    d = sub.add_parser("diff", help="growth between two snapshots")
    d.add_argument("recording")
    d.add_argument("t1", type=float)
    d.add_argument("t2", type=float)
    d.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    record(args) if args.cmd == "record" else diff(args)


if __name__ == "__main__":
    main()
