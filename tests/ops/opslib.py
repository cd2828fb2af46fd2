"""Helpers for the ops tests: free ports, a real karakvd in a temp dir, skip with a reason."""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

SKIP = 77  # ctest SKIP_RETURN_CODE


def skip(reason):
    print(f"SKIPPED: {reason}")
    sys.exit(SKIP)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_for(what, predicate, timeout=30, period=0.1):
    """Calls predicate until it returns something truthy; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # not up yet
            last_error = e
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last error: {last_error})")


class Daemon:
    """karakvd on a Unix socket in a fresh temp dir; stderr goes to a file the test can read."""

    def __init__(self, karakvd, *flags):
        self.dir = tempfile.mkdtemp(prefix="karakv-ops-")
        self.socket = os.path.join(self.dir, "karakv.sock")
        self.stderr_path = os.path.join(self.dir, "karakvd.stderr")
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen([karakvd, f"--socket={self.socket}", "--threads=2", *flags],
                                     stdout=subprocess.DEVNULL, stderr=self._stderr)
        wait_for("karakvd's socket", lambda: os.path.exists(self.socket) or self.proc.poll() is not None)
        if self.proc.poll() is not None:
            raise AssertionError(f"karakvd exited with {self.proc.returncode}: {self.stderr()}")

    @property
    def target(self):
        return f"unix:{self.socket}"

    def stderr(self):
        with open(self.stderr_path, "rb") as f:
            return f.read()

    def stop(self):
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)
