#!/usr/bin/env python3
"""scripts/smaps_growth.py against a real process: a child that, after a pause, starts a thread and
touches 4 MiB of an anonymous mapping. `record` must see it, and `diff` must put the 4 MiB under
"other anonymous", the new thread's stack under "thread stacks", and count the thread."""
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "scripts", "smaps_growth.py")

CHILD = r"""
import mmap, sys, threading, time
m = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
print("ready", flush=True)
sys.stdin.readline()
for off in range(0, 4 << 20, 4096):
    m[off] = 1
def deep(n):  # recursion touches a few pages of the new thread's stack
    return deep(n - 1) if n else 0
t = threading.Thread(target=lambda: (deep(200), time.sleep(30)), daemon=True)
t.start()
print("grown", flush=True)
time.sleep(30)
"""


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def main():
    if not os.path.exists("/proc/self/smaps"):
        print("SKIPPED: no /proc/PID/smaps here")
        sys.exit(77)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "smaps.jsonl")
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        try:
            if child.stdout.readline().strip() != "ready":
                fail("the child did not start")
            rec = subprocess.Popen([sys.executable, SCRIPT, "record", str(child.pid), out, "--every", "0.2",
                                    "--for", "2.5"])
            time.sleep(1.0)
            child.stdin.write("go\n")
            child.stdin.flush()
            if child.stdout.readline().strip() != "grown":
                fail("the child did not grow")
            if rec.wait(timeout=30) != 0:
                fail("record exited %d" % rec.returncode)
            diff = subprocess.run([sys.executable, SCRIPT, "diff", out, "0", "2.5"], capture_output=True, text=True,
                                  timeout=30)
        finally:
            child.kill()
            child.wait()
        print(diff.stdout, diff.stderr)
        if diff.returncode != 0:
            fail("diff exited %d" % diff.returncode)
        threads = re.search(r"threads (\d+) -> (\d+)", diff.stdout)
        if not threads or int(threads.group(2)) != int(threads.group(1)) + 1:
            fail("the new thread was not counted")
        kinds = {m.group(1).strip(): int(m.group(2)) for m in
                 re.finditer(r"^(.{32}) +-?\d+ +-?\d+ +([+-]\d+)$", diff.stdout, re.M)}
        if not 4096 <= kinds.get("other anonymous", 0) <= 4096 + 512:
            fail("other anonymous grew %s KiB, expected the 4096 KiB touched" % kinds.get("other anonymous"))
        if kinds.get("thread stacks", 0) <= 0:
            fail("no thread stack growth: %s" % kinds)
        if kinds.get("malloc arena heaps", 0) < 0 or "shared memory" in kinds:
            fail("unexpected kinds: %s" % kinds)
        # Nothing else anonymous changed by as much as the mapping the child touched.
        top = re.search(r"mappings that changed most.*?\n +\S+ rw-p +(\d+) KiB +(\d+) -> +(\d+)", diff.stdout, re.S)
        if not top or int(top.group(1)) != 16 << 10 or int(top.group(3)) - int(top.group(2)) < 4096:
            fail("the 16 MiB mapping is not the one that grew most")
    print("PASS")


if __name__ == "__main__":
    main()
