"""Run by install_test.sh with a freshly installed SDK: the package comes from the venv, is typed,
and its blocking and asyncio clients work against the karakvd at argv[1]."""
import asyncio
import os
import sys
import time

import numpy as np

import karakv
import karakv.aio
from karakv.v1 import karakv_pb2_grpc  # noqa: F401 (generated at install time)

target = sys.argv[1]
package = os.path.dirname(karakv.__file__)
assert package.startswith(sys.prefix), f"karakv imported from {package}, not from the venv {sys.prefix}"
for typed in ("py.typed", "v1/karakv_pb2.pyi"):
    assert os.path.isfile(os.path.join(package, typed)), f"the installed package lacks {typed}"

deadline = time.monotonic() + 20
while True:
    try:
        if karakv.health(target, timeout=1) == "SERVING":
            break
    except karakv.KaraKVError:
        pass
    if time.monotonic() > deadline:
        sys.exit(f"karakvd at {target} did not serve within 20 s")
    time.sleep(0.1)

k = np.ones((2, 5, 2, 16), np.float16)
with karakv.Client.attach(target, fast_path=True) as c:
    seq = c.create_sequence()
    assert c.append(seq, k, k) == 5
    out = c.step(0, [seq], k[0, :1], k[0, :1], np.ones((1, 4, 16), np.float32))
    assert out.shape == (1, 4, 16) and c.ring_calls == 2  # the Append and the Step


async def main():
    async with karakv.aio.Client.attach(target) as c:
        seq = await c.create_sequence()
        return await c.append(seq, k, k)

assert asyncio.run(main()) == 5
print(f"karakv {karakv.__version__} from {package}: blocking, fast path and asyncio clients OK")
