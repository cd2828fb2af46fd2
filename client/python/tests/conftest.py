"""Fixtures: real karakvd processes (the binary named by $KARAKVD) on temporary Unix sockets."""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

import karakv

# A small model geometry so the tests are fast; every test daemon serves it unless told otherwise.
GEOMETRY = ["--layers=2", "--q_heads=4", "--kv_heads=2", "--head_dim=16", "--dtype=fp16", "--block_size=4"]


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(port, line_start):
    """The value of the first /metrics line of the daemon at `port` that starts with `line_start`
    (e.g. 'karakv_decode_commands_total{method="Step",path="ring"}'), or 0 when there is none."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return 0


# A test run that crashes must not leave its daemons behind: util-linux's setpriv sets
# PR_SET_PDEATHSIG and execs the daemon (the signal survives exec), so Python never runs code in a
# forked child. A preexec_fn would: once this process has gRPC channels open (other tests', the
# asyncio client's threads), gRPC's fork handlers can abort that child before it execs (seen:
# "epoll_wait error: Bad file descriptor", SIGABRT).
_SETPRIV = shutil.which("setpriv")


class Daemon:
    def __init__(self, binary, args, workdir):
        self.socket = os.path.join(workdir, f"karakvd-{len(os.listdir(workdir))}.sock")
        self.target = "unix:" + self.socket
        self._binary, self._args = binary, args
        self._start()

    def _start(self, die_with_parent=True):
        wrap = [_SETPRIV, "--pdeathsig", "KILL"] if die_with_parent and _SETPRIV else []
        self.proc = subprocess.Popen([*wrap, self._binary, "--socket=" + self.socket, "--log_level=warn",
                                      "--threads=2", *self._args])
        args = self._args
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"karakvd exited with {self.proc.returncode} (args {args})")
            if os.path.exists(self.socket):
                try:
                    if karakv.health(self.target, timeout=1) == "SERVING":
                        return
                except karakv.KaraKVError:
                    pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("karakvd did not start serving within 20 s")

    def crash_and_restart(self):
        """SIGKILL, then a new karakvd (a new instance) on the same socket with the same flags."""
        self.proc.kill()
        self.proc.wait()
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        self._start()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def start_daemon():
    """start_daemon(*extra_flags) -> Daemon serving GEOMETRY; stopped after the test."""
    binary = os.environ.get("KARAKVD")
    if not binary or not os.access(binary, os.X_OK):
        pytest.skip("KARAKVD is not set to the karakvd binary (ctest sets it: ctest -R python_sdk)")
    started = []
    with tempfile.TemporaryDirectory(prefix="karakv-py-") as workdir:
        def start(*args, geometry=GEOMETRY):
            d = Daemon(binary, [*geometry, *args], workdir)
            started.append(d)
            return d
        yield start
        for d in started:
            d.stop()


@pytest.fixture
def daemon(start_daemon):
    return start_daemon("--pool_bytes=4MiB")
