#!/usr/bin/env python3
"""What a process's live heap gained between two moments of a heaptrack recording, by allocation stack.

    scripts/heap_growth.py RECORDING.zst T1_S T2_S [--top N] [--depth D]

heaptrack's own tools show the peak and what is leaked at exit; a daemon whose memory creeps under
load frees nearly everything at exit, so neither shows what it holds more of at minute 9 than at
minute 1. This replays the recording (heaptrack_interpret's text format: 'a SIZE TRACE' allocation
infos, '+ INFO' / '- INFO' allocations and frees, 'c MS' timestamps, 't IP PARENT' stack nodes,
'i IP MODULE [FUNCTION FILE LINE]...' frames, 's LEN TEXT' strings; numbers in hex) and snapshots
the live bytes per stack at T1 and T2 seconds. It prints the live totals at both moments, the
stacks that gained most, and the sum of what shrank. Record with scripts/heaptrack-exec.sh.
"""
import argparse
import collections
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recording", help="heaptrack output (.zst or .gz)")
    ap.add_argument("t1", type=float, help="first moment, seconds since the process started")
    ap.add_argument("t2", type=float, help="second moment (the end of the recording if later)")
    ap.add_argument("--top", type=int, default=10, help="stacks to print")
    ap.add_argument("--depth", type=int, default=12, help="frames per stack")
    args = ap.parse_args()
    if args.t2 <= args.t1:
        sys.exit("heap_growth: T2 (%g) must be later than T1 (%g)" % (args.t2, args.t1))

    strings, traces, frames, infos = [None], [None], [None], []
    live = collections.Counter()  # allocation info -> allocations alive
    snaps, now = {}, 0

    def snapshot():
        by_trace = collections.Counter()
        for info, count in live.items():
            if count:
                size, trace = infos[info]
                by_trace[trace] += count * size
        return by_trace

    reader = "zstd" if args.recording.endswith(".zst") else "gzip"
    proc = subprocess.Popen([reader, "-dc", args.recording], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, errors="replace")
    for line in proc.stdout:
        if not line.endswith("\n"):
            break  # a recording cut short (the process still running): stop at the last whole line
        kind = line[0]
        if kind == "+":
            live[int(line[2:], 16)] += 1
        elif kind == "-":
            live[int(line[2:], 16)] -= 1
        elif kind == "a":
            size, trace = line.split()[1:3]
            infos.append((int(size, 16), int(trace, 16)))
        elif kind == "t":
            ip, parent = line.split()[1:3]
            traces.append((int(ip, 16), int(parent, 16)))
        elif kind == "i":
            fields = line.split()[1:]
            frames.append(int(fields[2], 16) if len(fields) > 2 else 0)
        elif kind == "s":
            parts = line.rstrip("\n").split(" ", 2)
            strings.append(parts[2] if len(parts) > 2 else "")
        elif kind == "c":
            now = int(line[2:], 16)
            for name, t in (("t1", args.t1), ("t2", args.t2)):
                if name not in snaps and now >= t * 1000:
                    snaps[name] = snapshot()
    proc.wait()
    if "t1" not in snaps:
        sys.exit("heap_growth: the recording ends at %.1f s, before T1 = %g s" % (now / 1000, args.t1))
    if "t2" not in snaps:
        snaps["t2"] = snapshot()
        print("(the recording ends at %.1f s: T2 is its end)" % (now / 1000))

    def stack(trace):
        out = []
        while trace and len(out) < args.depth:
            ip, trace = traces[trace]
            fn = frames[ip]
            out.append(strings[fn][:120] if 0 < fn < len(strings) else "??")
        return out

    a, b = snaps["t1"], snaps["t2"]
    print("live heap: %.0f KiB at %g s, %.0f KiB at %g s (%+.0f KiB)" %
          (sum(a.values()) / 1024, args.t1, sum(b.values()) / 1024, args.t2, (sum(b.values()) - sum(a.values())) / 1024))
    diff = collections.Counter({t: b[t] - a[t] for t in set(a) | set(b)})
    for trace, gained in diff.most_common(args.top):
        if gained <= 0:
            break
        print("\n%+.1f KiB (%.1f -> %.1f KiB)" % (gained / 1024, a[trace] / 1024, b[trace] / 1024))
        for frame in stack(trace):
            print("    " + frame)
    print("\nshrank, all stacks together: %.1f KiB" % (sum(d for d in diff.values() if d < 0) / 1024))


if __name__ == "__main__":
    main()
