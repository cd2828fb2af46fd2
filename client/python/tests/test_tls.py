"""TLS and mutual TLS to karakvd's TCP listener, blocking and asyncio clients. The test makes a
throwaway CA, a server certificate for 127.0.0.1/localhost, a client certificate from the same CA
and a server certificate from another CA (the openssl CLI)."""
import asyncio
import shutil
import subprocess

import numpy as np
import pytest

import karakv
import karakv.aio
from conftest import free_port

KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed (scripts/setup.sh installs it)")
    d = tmp_path_factory.mktemp("tls")
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    for ca in ("ca", "other-ca"):
        run("req", "-x509", *KEY, "-days", "1", "-subj", f"/CN={ca}", "-keyout", f"{ca}.key", "-out", f"{ca}.crt",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=keyCertSign,cRLSign")
    for name, cn, issuer, ext in (("server", "localhost", "ca", "server"), ("client", "worker", "ca", "client")):
        run("req", *KEY, "-subj", f"/CN={cn}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
        run("x509", "-req", "-days", "1", "-in", f"{name}.csr", "-CA", f"{issuer}.crt", "-CAkey", f"{issuer}.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-extfile", f"{ext}.ext")
    return d


def tls_daemon(start_daemon, certs, mutual=False):
    port = free_port()
    flags = ["--pool_bytes=4MiB", f"--listen_tcp=127.0.0.1:{port}", f"--tls_cert={certs / 'server.crt'}",
             f"--tls_key={certs / 'server.key'}"]
    if mutual:
        flags.append(f"--tls_client_ca={certs / 'ca.crt'}")
    start_daemon(*flags)
    return f"127.0.0.1:{port}"


def test_tls_attach_and_calls_with_the_daemons_ca(start_daemon, certs):
    target = tls_daemon(start_daemon, certs)
    ca = str(certs / "ca.crt")
    assert karakv.health(target, tls_ca_file=ca) == "SERVING"
    # A TCP worker is on another host: no staging region, tensors travel inline.
    with karakv.Client.attach(target, tls_ca_file=ca, staging_bytes=0) as c:
        seq = c.create_sequence()
        k = np.ones((2, 3, 2, 16), np.float16)
        assert c.append(seq, k, k) == 3
        assert c.stats().sessions == 1
    # Plaintext to a TLS port, and TLS that trusts another CA, never get a session.
    with pytest.raises(karakv.Unavailable):
        karakv.Client.attach(target, staging_bytes=0, rpc_timeout=5)
    with pytest.raises(karakv.Unavailable):
        karakv.Client.attach(target, tls_ca_file=str(certs / "other-ca.crt"), staging_bytes=0, rpc_timeout=5)
    with pytest.raises(karakv.Unavailable):
        karakv.health(target, tls_ca_file=str(certs / "other-ca.crt"))


def test_mutual_tls_needs_a_client_certificate(start_daemon, certs):
    target = tls_daemon(start_daemon, certs, mutual=True)
    ca = str(certs / "ca.crt")
    with karakv.Client.attach(target, tls_ca_file=ca, tls_cert_file=str(certs / "client.crt"),
                              tls_key_file=str(certs / "client.key"), staging_bytes=0) as c:
        c.ping()
    with pytest.raises(karakv.Unavailable):
        karakv.Client.attach(target, tls_ca_file=ca, staging_bytes=0, rpc_timeout=5)


def test_asyncio_client_over_tls(start_daemon, certs):
    target = tls_daemon(start_daemon, certs)

    async def main():
        async with karakv.aio.Client.attach(target, tls_ca_file=str(certs / "ca.crt"), staging_bytes=0) as c:
            seq = await c.create_sequence()
            return seq, (await c.stats()).sequences

    seq, sequences = asyncio.run(main())
    assert seq > 0 and sequences == 1


def test_tls_option_errors_say_what_was_wrong(daemon, certs, tmp_path):
    with pytest.raises(karakv.InvalidArgument, match="tls_cert_file and tls_key_file go together"):
        karakv.Client.attach("127.0.0.1:1", tls_cert_file=str(certs / "client.crt"))
    with pytest.raises(karakv.InvalidArgument, match=r"tls_ca_file=.*missing.pem: cannot read it \(No such file"):
        karakv.Client.attach("127.0.0.1:1", tls_ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(karakv.InvalidArgument, match="Unix socket never speaks TLS"):
        karakv.Client.attach(daemon.target, tls=True)
