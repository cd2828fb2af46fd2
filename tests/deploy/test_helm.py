"""helm/karakv rendered by Helm's own engine (helm-python-sdk: Helm v4 as a library), every manifest
validated against the Kubernetes OpenAPI schemas (kubernetes-validate, strict), and the facts that
matter checked on the parsed YAML. The rendered karakvd config file and the exec probe command are
then run for real: karakvd must accept the config, and the probe must report a serving daemon."""
import os
import shlex
import signal
import subprocess
import time

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

CHART = os.path.join(os.path.dirname(__file__), "..", "..", "helm", "karakv")
# The chart needs native sidecars (1.29); check the oldest version it supports and the newest
# schemas kubernetes-validate ships.
KUBE_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]

MODES = {
    "sidecar": {},
    "sidecar-plain-container": {"sidecar": {"native": False}},
    "sidecar-servicemonitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    "daemonset": {"mode": "daemonset"},
    "daemonset-servicemonitor-grpc-probe": {"mode": "daemonset", "probes": {"type": "grpc"},
                                            "serviceMonitor": {"enabled": True}},
}


def render(values):
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name="kv", namespace="llm")
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def pod_spec(docs):
    (workload,) = by_kind(docs, "Deployment") + by_kind(docs, "DaemonSet")
    return workload["spec"]["template"]["spec"]


def daemon_container(spec):
    (c,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "karakvd"]
    return c


def mounts(container):
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


def test_lint_is_clean():
    report = helm.lint(CHART, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_manifest_validates(mode):
    docs = render(MODES[mode])
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") + kinds.count("DaemonSet") == 1, kinds
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            # A CRD: kubernetes-validate knows only built-in kinds, and says so.
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_validator_rejects_a_broken_manifest():
    # The validation above can fail: a typo in a pod spec field is refused.
    (dep,) = by_kind(render({}), "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBE_VERSIONS[-1], strict=True)


def test_sidecar_shares_socket_and_shm_with_the_worker():
    docs = render({})
    spec = pod_spec(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in volumes["karakv-socket"]
    daemon = daemon_container(spec)
    assert daemon["restartPolicy"] == "Always"  # a native sidecar: up before the worker starts
    (worker,) = spec["containers"]
    for c in (daemon, worker):
        assert mounts(c)["dshm"] == "/dev/shm"
        assert mounts(c)["karakv-socket"] == "/run/karakv"
    env = {e["name"]: e["value"] for e in worker["env"]}
    assert env["KARAKV_TARGET"] == "unix:/run/karakv/karakv.sock"
    # Staging regions are mode 0600: worker and daemon must be the same user.
    assert worker["securityContext"]["runAsUser"] == daemon["securityContext"]["runAsUser"]


def test_sidecar_as_a_plain_container():
    spec = pod_spec(render(MODES["sidecar-plain-container"]))
    assert "initContainers" not in spec
    assert sorted(c["name"] for c in spec["containers"]) == ["karakvd", "model-worker"]
    assert "restartPolicy" not in daemon_container(spec)


def test_daemonset_on_gpu_nodes_with_hostpaths():
    docs = render(MODES["daemonset"])
    (ds,) = by_kind(docs, "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["karakv-socket"]["hostPath"]["path"] == "/run/karakv/sock"
    assert volumes["dshm"]["hostPath"]["path"] == "/run/karakv/shm"
    assert mounts(daemon_container(spec)) == {"karakv-socket": "/run/karakv", "dshm": "/dev/shm",
                                              "config": "/etc/karakv"}
    (init,) = spec["initContainers"]
    # The one root container: it only chowns the hostPath directories.
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert "chown 10001:10001 /host/sock /host/shm" in init["args"][0]


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_non_root_and_resources(mode):
    spec = pod_spec(render(MODES[mode]))
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    daemon = daemon_container(spec)
    sc = daemon["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
    assert daemon["resources"]["requests"]["memory"] == "1Gi"
    assert daemon["resources"]["limits"]["memory"] == "2Gi"


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_exec_probes_use_the_health_cli_on_the_socket(mode):
    daemon = daemon_container(pod_spec(render(MODES[mode])))
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert daemon[probe]["exec"]["command"] == [
            "karakv", "--target=unix:/run/karakv/karakv.sock", "--timeout=5", "health"]


def test_grpc_probe_opens_the_tcp_port_it_probes():
    docs = render(MODES["daemonset-servicemonitor-grpc-probe"])
    daemon = daemon_container(pod_spec(docs))
    assert daemon["livenessProbe"]["grpc"] == {"port": 50051}
    assert {"name": "grpc", "containerPort": 50051, "protocol": "TCP"} in daemon["ports"]
    (cm,) = by_kind(docs, "ConfigMap")
    assert "listen_tcp=0.0.0.0:50051" in cm["data"]["karakvd.conf"].splitlines()


def test_servicemonitor_scrapes_the_metrics_service():
    docs = render(MODES["sidecar-servicemonitor"])
    (sm,) = by_kind(docs, "ServiceMonitor")
    (svc,) = by_kind(docs, "Service")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    (dep,) = by_kind(docs, "Deployment")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in daemon_container(pod_spec(docs))["ports"]}
    assert ports["metrics"] == svc["spec"]["ports"][0]["port"] == 9464
    assert not by_kind(render({}), "ServiceMonitor")


def test_chart_refuses_bad_values():
    with pytest.raises(helm.HelmError, match="mode=deployment unknown; expected sidecar or daemonset"):
        render({"mode": "deployment"})
    with pytest.raises(helm.HelmError, match="probes.type=tcp unknown"):
        render({"probes": {"type": "tcp"}})
    with pytest.raises(helm.HelmError, match="config.socket is set by the chart"):
        render({"config": {"socket": "/x.sock"}})
    with pytest.raises(helm.HelmError, match="needs metrics.enabled"):
        render({"serviceMonitor": {"enabled": True}, "metrics": {"enabled": False}})


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_karakvd_accepts_the_config_and_the_probe_passes(mode, tmp_path):
    karakvd, cli = os.environ.get("KARAKVD"), os.environ.get("KARAKV_CLI")
    if not (karakvd and cli):
        pytest.skip("KARAKVD and KARAKV_CLI are not set (ctest sets them)")
    # The chart's defaults, with a small pool so the test is light; metrics off so no fixed port.
    docs = render({**MODES[mode], "config": {"pool_bytes": "8MiB"}, "metrics": {"enabled": False}})
    (cm,) = by_kind(docs, "ConfigMap")
    conf = cm["data"]["karakvd.conf"]
    assert "socket=/run/karakv/karakv.sock" in conf.splitlines()
    sock = str(tmp_path / "karakv.sock")
    (tmp_path / "karakvd.conf").write_text(conf.replace("/run/karakv/karakv.sock", sock))
    daemon = daemon_container(pod_spec(docs))
    assert daemon["args"] == ["--config=/etc/karakv/karakvd.conf"]
    args = [karakvd, f"--config={tmp_path / 'karakvd.conf'}"]
    probe = [cli if a == "karakv" else a.replace("/run/karakv/karakv.sock", sock)
             for a in daemon["readinessProbe"]["exec"]["command"]]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        result = None
        while time.monotonic() < deadline and proc.poll() is None:
            result = subprocess.run(probe, capture_output=True, text=True)
            if result.returncode == 0:
                break
            time.sleep(0.1)
        assert proc.poll() is None, f"karakvd refused the chart's config: {proc.stdout.read()}"
        assert result is not None and result.returncode == 0, shlex.join(probe) + ": " + result.stderr
        assert result.stdout.strip() == "SERVING"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    # A stopped daemon fails the probe, so the probe can fail.
    assert subprocess.run(probe, capture_output=True).returncode != 0
