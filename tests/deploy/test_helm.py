"""helm/karakv rendered by Helm's own engine (helm-python-sdk: Helm v4 as a library), every manifest
validated against the Kubernetes OpenAPI schemas (kubernetes-validate, strict), and the facts that
matter checked on the parsed YAML. The rendered karakvd config file and the exec probe command are
then run for real: karakvd must accept the config, and the probe must report a serving daemon.
The monitoring objects are checked against each other: the job label the ServiceMonitor or
PodMonitor gives karakvd's series is what the PrometheusRule's and the dashboard's selectors match."""
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CHART = os.path.join(ROOT, "helm", "karakv")
ALERTS = os.path.join(ROOT, "deploy", "prometheus", "alerts.yml")
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "karakv-dashboard.json")
CRDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")  # the Prometheus Operator's
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
    "sidecar-podmonitor-rules-dashboard-netpol": {
        "podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True},
        "grafanaDashboard": {"enabled": True}, "networkPolicy": {"enabled": True}},
    "daemonset-servicemonitor-rules-dashboard-netpol": {
        "mode": "daemonset", "serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True},
        "grafanaDashboard": {"enabled": True, "namespace": "monitoring"},
        "networkPolicy": {"enabled": True, "metricsFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}},
}
# A model worker as it is deployed for real: an API port with probes, weights on a volume mounted
# read-only, a writable cache (the root filesystem is read-only), ingress to its API.
REAL_WORKER = {
    "nameOverride": "kvcache",
    "sidecar": {
        "worker": {
            "name": "vllm", "image": "vllm/vllm-openai:v0.9.0", "command": ["vllm"], "args": ["serve", "/models/m"],
            "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
            "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "failureThreshold": 120},
            "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}},
            "livenessProbe": {"tcpSocket": {"port": "http"}},
            "volumeMounts": [{"name": "weights", "mountPath": "/models", "readOnly": True},
                             {"name": "cache", "mountPath": "/home/worker/.cache"}],
            "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}},
            "resources": {"limits": {"nvidia.com/gpu": 1}},
        },
        "volumes": [{"name": "weights", "persistentVolumeClaim": {"claimName": "llama-weights", "readOnly": True}},
                    {"name": "cache", "emptyDir": {"sizeLimit": "10Gi"}}],
    },
    "networkPolicy": {"enabled": True, "extraIngress": [{"ports": [{"port": "http", "protocol": "TCP"}]}]},
}
MODES["sidecar-real-worker"] = REAL_WORKER
MODES["sidecar-mps"] = {"mps": {"enabled": True}}
MODES["daemonset-mps"] = {"mode": "daemonset", "mps": {"enabled": True, "pipeDirectory": "/run/nvidia-mps"}}


def render(values, name="kv", namespace="llm"):
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=name, namespace=namespace)
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


@pytest.mark.parametrize("mode", [None] + sorted(MODES))
def test_lint_is_clean(mode):
    report = helm.lint(CHART, MODES.get(mode), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_manifest_validates(mode):
    docs = render(MODES[mode])
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") + kinds.count("DaemonSet") == 1, kinds
    for doc in docs:
        if doc["kind"] in CRDS:
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


def test_sidecar_shares_the_pid_namespace_only_when_asked_and_the_fd_socket_is_in_the_shared_volume():
    assert "shareProcessNamespace" not in pod_spec(render({}))
    spec = pod_spec(render({"sidecar": {"shareProcessNamespace": True}}))
    assert spec["shareProcessNamespace"] is True
    # karakvd's staging fd socket defaults to <socket>.fd: the socket's directory, which both mount.
    (cm,) = by_kind(render({}), "ConfigMap")
    (config,) = cm["data"].values()
    settings = dict(line.split("=", 1) for line in config.splitlines() if "=" in line)
    assert "staging_fd_socket" not in settings
    assert os.path.dirname(settings["socket"]) == mounts(daemon_container(spec))["karakv-socket"]


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
def test_mps_gives_every_cuda_process_the_nodes_pipe_directory(mode):
    def cuda_containers(spec):
        # karakvd, and in sidecar mode the worker: the two processes that share the GPU.
        return [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] in ("karakvd", "model-worker")]

    spec = pod_spec(render(MODES[mode + "-mps"]))
    pipe = MODES[mode + "-mps"]["mps"].get("pipeDirectory", "/tmp/nvidia-mps")
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["nvidia-mps"]["hostPath"] == {"path": pipe, "type": "Directory"}
    containers = cuda_containers(spec)
    assert len(containers) == (2 if mode == "sidecar" else 1)
    for c in containers:
        assert {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": pipe} in c["env"], c["name"]
        assert mounts(c)["nvidia-mps"] == pipe, c["name"]
    # Off (the default): no volume, no mount, no variable.
    spec = pod_spec(render(MODES[mode]))
    assert "nvidia-mps" not in {v["name"] for v in spec["volumes"]}
    for c in cuda_containers(spec):
        assert "nvidia-mps" not in mounts(c)
        assert all(e["name"] != "CUDA_MPS_PIPE_DIRECTORY" for e in c.get("env", []))


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


HEARTBEAT = "/run/karakv/karakv.sock.alive"


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_exec_probes_use_the_health_cli_and_liveness_only_the_heartbeat(mode):
    daemon = daemon_container(pod_spec(render(MODES[mode])))
    for probe in ("startupProbe", "readinessProbe"):
        assert daemon[probe]["exec"]["command"] == [
            "karakv", "--target=unix:/run/karakv/karakv.sock", "--timeout=5", "health"]
    # Liveness makes no call: a slow daemon is NotReady, only a wedged one is restarted.
    assert daemon["livenessProbe"]["exec"]["command"] == [
        "karakv", f"--heartbeat_file={HEARTBEAT}", "--max_age=60", "liveness"]
    # The defaults: 120 s to start, three slow answers before NotReady, killed after its heartbeat
    # has been over 60 s old for three probes.
    assert (daemon["startupProbe"]["periodSeconds"], daemon["startupProbe"]["failureThreshold"]) == (2, 60)
    assert (daemon["readinessProbe"]["periodSeconds"], daemon["readinessProbe"]["failureThreshold"]) == (10, 3)
    assert (daemon["livenessProbe"]["periodSeconds"], daemon["livenessProbe"]["failureThreshold"]) == (10, 3)
    (cm,) = [c for c in by_kind(render(MODES[mode]), "ConfigMap")]
    assert f"heartbeat_file={HEARTBEAT}" in cm["data"]["karakvd.conf"].splitlines()


def test_probe_thresholds_and_the_startup_budget_are_values():
    daemon = daemon_container(pod_spec(render({"probes": {
        "startup": {"periodSeconds": 5, "failureThreshold": 120},
        "readiness": {"periodSeconds": 15, "failureThreshold": 4},
        "liveness": {"periodSeconds": 20, "failureThreshold": 6, "maxAgeSeconds": 300}}})))
    assert (daemon["startupProbe"]["periodSeconds"], daemon["startupProbe"]["failureThreshold"]) == (5, 120)
    assert (daemon["readinessProbe"]["periodSeconds"], daemon["readinessProbe"]["failureThreshold"]) == (15, 4)
    assert (daemon["livenessProbe"]["periodSeconds"], daemon["livenessProbe"]["failureThreshold"]) == (20, 6)
    assert "--max_age=300" in daemon["livenessProbe"]["exec"]["command"]


def test_grpc_probe_opens_the_tcp_port_it_probes():
    docs = render(MODES["daemonset-servicemonitor-grpc-probe"])
    daemon = daemon_container(pod_spec(docs))
    assert daemon["readinessProbe"]["grpc"] == daemon["startupProbe"]["grpc"] == {"port": 50051}
    assert daemon["livenessProbe"]["exec"]["command"][-1] == "liveness"
    assert {"name": "grpc", "containerPort": 50051, "protocol": "TCP"} in daemon["ports"]
    (cm,) = by_kind(docs, "ConfigMap")
    assert "listen_tcp=0.0.0.0:50051" in cm["data"]["karakvd.conf"].splitlines()


def test_kv_events_config_ports_and_network_policy():
    values = {"kvEvents": {"enabled": True, "from": [{"podSelector": {"matchLabels": {"app": "router"}}}]},
              "networkPolicy": {"enabled": True}}
    for mode in ("sidecar", "daemonset"):
        docs = render({**values, "mode": mode})
        lines = by_kind(docs, "ConfigMap")[0]["data"]["karakvd.conf"].splitlines()
        for line in ("kv_events_endpoint=tcp://*:5557", "kv_events_replay_endpoint=tcp://*:5558",
                     "kv_events_encoding=array"):
            assert line in lines
        ports = {p["name"]: p["containerPort"] for p in daemon_container(pod_spec(docs))["ports"]}
        assert ports["kv-events"] == 5557 and ports["kv-events-replay"] == 5558
        (np,) = by_kind(docs, "NetworkPolicy")
        (rule,) = [r for r in np["spec"]["ingress"] if {"port": 5557, "protocol": "TCP"} in r["ports"]]
        assert rule["ports"] == [{"port": 5557, "protocol": "TCP"}, {"port": 5558, "protocol": "TCP"}]
        assert rule["from"] == [{"podSelector": {"matchLabels": {"app": "router"}}}]
    docs = render({"kvEvents": {"enabled": True, "replayPort": 0, "encoding": "map"}})
    lines = by_kind(docs, "ConfigMap")[0]["data"]["karakvd.conf"].splitlines()
    assert "kv_events_encoding=map" in lines and not [l for l in lines if l.startswith("kv_events_replay")]
    assert "kv-events-replay" not in {p["name"] for p in daemon_container(pod_spec(docs))["ports"]}
    assert not [l for l in by_kind(render({}), "ConfigMap")[0]["data"]["karakvd.conf"].splitlines()
                if l.startswith("kv_events")]
    with pytest.raises(helm.HelmError, match="config.kv_events_endpoint is set by the chart"):
        render({"config": {"kv_events_endpoint": "tcp://*:1"}})


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_prefix_tier_address_timeout_and_password_secret(mode):
    docs = render({"mode": mode, "prefixTier": {"address": "redis-a:6379,redis-b:6379", "passwordSecret": "redis-pw",
                                                "passwordKey": "karakv", "timeoutMs": 80}})
    lines = by_kind(docs, "ConfigMap")[0]["data"]["karakvd.conf"].splitlines()
    for line in ("prefix_tier=redis://redis-a:6379,redis-b:6379", "prefix_tier_timeout_ms=80",
                 "prefix_tier_password_file=/etc/karakv/prefix-tier/karakv"):
        assert line in lines
    spec = pod_spec(docs)
    assert mounts(daemon_container(spec))["prefix-tier"] == "/etc/karakv/prefix-tier"
    (vol,) = [v for v in spec["volumes"] if v["name"] == "prefix-tier"]
    assert vol["secret"] == {"secretName": "redis-pw", "defaultMode": 0o440,
                             "items": [{"key": "karakv", "path": "karakv"}]}
    for c in spec.get("initContainers", []) + spec["containers"]:
        if c["name"] != "karakvd":
            assert "prefix-tier" not in mounts(c)
    # Without a Secret: no password file, no volume; off by default.
    lines = by_kind(render({"prefixTier": {"address": "r:6379"}}), "ConfigMap")[0]["data"]["karakvd.conf"].splitlines()
    assert "prefix_tier=redis://r:6379" in lines and not [l for l in lines if l.startswith("prefix_tier_password")]
    assert not [l for l in by_kind(render({}), "ConfigMap")[0]["data"]["karakvd.conf"].splitlines()
                if l.startswith("prefix_tier")]
    with pytest.raises(helm.HelmError, match="prefixTier.address is empty"):
        render({"prefixTier": {"passwordSecret": "redis-pw"}})
    with pytest.raises(helm.HelmError, match="prefixTier"):
        render({"prefixTier": {"address": "redis://r:6379"}})  # the chart adds the scheme
    with pytest.raises(helm.HelmError, match="config.prefix_tier is set by the chart"):
        render({"config": {"prefix_tier": "redis://r:1"}})


DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize("mode", ["sidecar", "sidecar-plain-container", "daemonset"])
def test_image_digest_pins_every_chart_image(mode):
    spec = pod_spec(render({**MODES[mode], "image": {"digest": DIGEST}}))
    images = {c["name"]: c["image"] for c in spec.get("initContainers", []) + spec["containers"]}
    # karakvd, the DaemonSet's host-dirs init container and the example worker all run this image.
    assert images and set(images.values()) == {f"ghcr.io/karakv/karakvd:0.1.0@{DIGEST}"}, images
    # Without a digest: the tag, appVersion by default, for the example worker too.
    spec = pod_spec(render({**MODES[mode], "image": {"tag": "0.1.1"}}))
    assert {c["image"] for c in spec.get("initContainers", []) + spec["containers"]} == {
        "ghcr.io/karakv/karakvd:0.1.1"}
    # A worker image of its own is left alone.
    if mode.startswith("sidecar"):
        spec = pod_spec(render({**MODES[mode], "image": {"digest": DIGEST},
                                "sidecar": {"worker": {"image": "vllm/vllm-openai:v0.9.0"}}}))
        (worker,) = [c for c in spec["containers"] if c["name"] == "model-worker"]
        assert worker["image"] == "vllm/vllm-openai:v0.9.0"


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_no_service_account_token_and_the_priority_class(mode):
    for sa in ({}, {"serviceAccount": {"create": False}}):
        spec = pod_spec(render({**MODES[mode], **sa}))
        assert spec["automountServiceAccountToken"] is False
        assert "priorityClassName" not in spec
    spec = pod_spec(render({**MODES[mode], "priorityClassName": "system-node-critical",
                            "serviceAccount": {"automountToken": True}}))
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["automountServiceAccountToken"] is True


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_tls_secret_is_mounted_and_configured(mode):
    docs = render({**MODES[mode], "tls": {"secretName": "kv-tls", "port": 50443, "clientCA": True}})
    spec = pod_spec(docs)
    daemon = daemon_container(spec)
    assert mounts(daemon)["tls"] == "/etc/karakv/tls"
    assert [m for m in daemon["volumeMounts"] if m["name"] == "tls"][0]["readOnly"] is True
    (vol,) = [v for v in spec["volumes"] if v["name"] == "tls"]
    assert vol["secret"] == {"secretName": "kv-tls", "defaultMode": 0o440}
    assert {"name": "grpc-tls", "containerPort": 50443, "protocol": "TCP"} in daemon["ports"]
    (cm,) = by_kind(docs, "ConfigMap")
    lines = cm["data"]["karakvd.conf"].splitlines()
    for line in ("listen_tcp=0.0.0.0:50443", "tls_cert=/etc/karakv/tls/tls.crt", "tls_key=/etc/karakv/tls/tls.key",
                 "tls_client_ca=/etc/karakv/tls/ca.crt"):
        assert line in lines
    # The worker does not see the key.
    for c in spec.get("initContainers", []) + spec["containers"]:
        if c["name"] != "karakvd":
            assert "tls" not in mounts(c)
    lines = by_kind(render({"tls": {"secretName": "kv-tls"}}), "ConfigMap")[0]["data"]["karakvd.conf"].splitlines()
    assert not [l for l in lines if l.startswith("tls_client_ca=")]
    assert "tls" not in mounts(daemon_container(pod_spec(render({}))))


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
    with pytest.raises(helm.HelmError, match="config.socket is set by the chart"):
        render({"config": {"socket": "/x.sock"}})
    with pytest.raises(helm.HelmError, match="serviceMonitor.enabled needs metrics.enabled"):
        render({"serviceMonitor": {"enabled": True}, "metrics": {"enabled": False}})
    with pytest.raises(helm.HelmError, match="podMonitor.enabled needs metrics.enabled"):
        render({"podMonitor": {"enabled": True}, "metrics": {"enabled": False}})
    with pytest.raises(helm.HelmError, match="choose one, or Prometheus scrapes each daemon twice"):
        render({"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}})
    with pytest.raises(helm.HelmError, match="runAsUser=0 differs from securityContext.runAsUser=10001"):
        render({"sidecar": {"worker": {"securityContext": {"runAsUser": 0}}}})
    with pytest.raises(helm.HelmError, match="volume name dshm is the chart's own"):
        render({"sidecar": {"volumes": [{"name": "dshm", "emptyDir": {}}]}})
    with pytest.raises(helm.HelmError, match="volume name tls is the chart's own"):
        render({"sidecar": {"volumes": [{"name": "tls", "emptyDir": {}}]}})
    with pytest.raises(helm.HelmError, match="config.heartbeat_file is set by the chart"):
        render({"config": {"heartbeat_file": "/tmp/x"}})
    with pytest.raises(helm.HelmError, match="config.tls_cert is set by the chart"):
        render({"config": {"tls_cert": "/x.pem"}})
    with pytest.raises(helm.HelmError, match="tls.secretName needs probes.type=exec"):
        render({"tls": {"secretName": "kv-tls"}, "probes": {"type": "grpc"}})


@pytest.mark.parametrize("values, where", [
    ({"mode": "deployment"}, "/mode"),
    ({"probes": {"type": "tcp"}}, "/probes/type"),
    ({"serviceMonitor": {"enable": True}}, "/serviceMonitor"),    # a typo, not silently ignored
    ({"mps": {"enabled": True, "pipeDirectory": "nvidia-mps"}}, "/mps/pipeDirectory"),  # not a node path
    ({"metrics": {"port": 70000}}, "/metrics/port"),
    ({"metrics": {"port": "9464"}}, "/metrics/port"),
    ({"podMonitor": {"enabled": True, "interval": "15"}}, "/podMonitor/interval"),
    ({"nameOverride": "Karakv_Daemon"}, "/nameOverride"),
    ({"securityContext": {"runAsUser": 0}}, "/securityContext/runAsUser"),
    ({"sidecar": {"worker": {"ports": 8000}}}, "/sidecar/worker/ports"),
    ({"networkPolicy": {"enabled": "yes"}}, "/networkPolicy/enabled"),
    ({"grafanaDashboard": {"enabled": True, "labels": {"grafana_dashboard": 1}}},
     "/grafanaDashboard/labels/grafana_dashboard"),
    ({"image": {"digest": "sha256:1234"}}, "/image/digest"),
    ({"image": {"digest": "ab" * 32}}, "/image/digest"),
    ({"probes": {"periodSeconds": 10}}, "/probes"),           # the old flat settings: said, not ignored
    ({"probes": {"liveness": {"maxAgeSeconds": 0}}}, "/probes/liveness/maxAgeSeconds"),
    ({"probes": {"startup": {"failureThreshold": "60"}}}, "/probes/startup/failureThreshold"),
    ({"tls": {"secretName": "KV_TLS"}}, "/tls/secretName"),
    ({"priorityClassName": "High Priority"}, "/priorityClassName"),
    ({"kvEvents": {"encoding": "json"}}, "/kvEvents/encoding"),
    ({"serviceAccount": {"automountToken": "no"}}, "/serviceAccount/automountToken"),
])
def test_values_schema_rejects_bad_values(values, where):
    with pytest.raises(helm.HelmValuesError, match=re.escape(f"at '{where}'")):
        render(values)


def test_templates_refuse_bad_values_without_the_schema(tmp_path):
    # helm install --skip-schema-validation: the templates' own checks still refuse.
    chart = shutil.copytree(CHART, tmp_path / "karakv")  # copies the linked files' contents
    os.remove(chart / "values.schema.json")
    with helm.Chart.load(chart) as c:
        with pytest.raises(helm.HelmError, match="mode=deployment unknown; expected sidecar or daemonset"):
            c.render({"mode": "deployment"}, name="kv", namespace="llm")
        with pytest.raises(helm.HelmError, match="probes.type=tcp unknown"):
            c.render({"probes": {"type": "tcp"}}, name="kv", namespace="llm")
        with pytest.raises(helm.HelmError, match="image.digest=sha256:12 is not a digest"):
            c.render({"image": {"digest": "sha256:12"}}, name="kv", namespace="llm")


# --- Pod Security Standards ------------------------------------------------------------------------
# The checks of https://kubernetes.io/docs/concepts/security/pod-security-standards/ that a pod
# spec can fail, as the admission controller applies them (v1.29+): the level a namespace must
# allow for the pod, "restricted", "baseline" or "privileged".
BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def pod_security_violations(spec):
    containers = spec.get("initContainers", []) + spec["containers"]
    pod_sc = spec.get("securityContext", {})
    baseline, restricted = [], []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            baseline.append(key)
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if "hostPath" in kinds:
            baseline.append(f"volume {v['name']}: hostPath")
        if not kinds <= RESTRICTED_VOLUMES:
            restricted.append(f"volume {v['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    if pod_sc.get("seccompProfile", {}).get("type") == "Unconfined":
        baseline.append("pod seccomp Unconfined")
    for c in containers:
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            baseline.append(f"{name}: privileged")
        added = set(sc.get("capabilities", {}).get("add", []))
        if added - BASELINE_CAPS:
            baseline.append(f"{name}: adds {sorted(added - BASELINE_CAPS)}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            baseline.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            baseline.append(f"{name}: procMount")
        if sc.get("seccompProfile", {}).get("type") == "Unconfined":
            baseline.append(f"{name}: seccomp Unconfined")
        if sc.get("allowPrivilegeEscalation") is not False:
            restricted.append(f"{name}: allowPrivilegeEscalation not false")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            restricted.append(f"{name}: runAsNonRoot not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            restricted.append(f"{name}: runAsUser 0")
        if sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type") not in ("RuntimeDefault", "Localhost"):
            restricted.append(f"{name}: no RuntimeDefault seccomp")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            restricted.append(f"{name}: capabilities not dropped")
        if added - {"NET_BIND_SERVICE"}:
            restricted.append(f"{name}: adds {sorted(added)}")
    return baseline, restricted


def pod_security_level(spec):
    baseline, restricted = pod_security_violations(spec)
    return "privileged" if baseline else "baseline" if restricted else "restricted"


def test_pod_security_check_can_fail():
    spec = pod_spec(render({}))
    assert pod_security_level(spec) == "restricted"
    daemon_container(spec)["securityContext"]["allowPrivilegeEscalation"] = True
    assert pod_security_level(spec) == "baseline"
    daemon_container(spec)["securityContext"]["privileged"] = True
    assert pod_security_level(spec) == "privileged"


# The levels helm/README.md promises ("Pod Security"): sidecar mode meets restricted (with the
# TLS Secret too); the DaemonSet's hostPaths need privileged, with or without its root init
# container; a worker that adds a capability outside baseline's list (IPC_LOCK) needs privileged, and
# so does MPS's hostPath pipe directory.
@pytest.mark.parametrize("values, level", [
    ({}, "restricted"),
    ({"sidecar": {"native": False}}, "restricted"),
    ({"tls": {"secretName": "kv-tls"}, "sidecar": {"shareProcessNamespace": True}}, "restricted"),
    ({"mode": "daemonset"}, "privileged"),
    ({"mode": "daemonset", "daemonset": {"fixPermissions": False}}, "privileged"),
    (REAL_WORKER, "privileged"),
    ({"mps": {"enabled": True}}, "privileged"),   # the MPS pipe directory is a hostPath
])
def test_pod_security_level_of_each_mode(values, level):
    assert pod_security_level(pod_spec(render(values))) == level, pod_security_violations(pod_spec(render(values)))


# --- checkov ---------------------------------------------------------------------------------------
# checkov's Kubernetes policies over every rendered mode, as an operator following helm/README.md
# deploys them (images pinned by digest, the worker's too). The classes the chart promises, image
# digest (CKV_K8S_43) and service-account token (CKV_K8S_38), fail nowhere; every other failing
# check is one helm/README.md lists under "checkov" with its reason, and it lists no check that
# passes everywhere (a stale entry).
PROMISED = {"CKV_K8S_43", "CKV_K8S_38"}
README = os.path.join(ROOT, "helm", "README.md")


def checkov_failures(values_by_mode, tmp_path):
    venv = os.environ.get("CHECKOV_VENV", "")
    checkov = os.path.join(venv, "bin", "checkov")
    if not os.path.exists(checkov):
        reason = open(venv + ".skip").read().strip() if os.path.exists(venv + ".skip") else "no checkov venv"
        pytest.skip(f"checkov: {reason}")
    out = tmp_path / "rendered"
    out.mkdir(parents=True)
    for mode, values in values_by_mode.items():
        with open(out / f"{mode}.yaml", "w") as f:
            yaml.safe_dump_all(render(values), f)
    run = subprocess.run([checkov, "-d", str(out), "--framework", "kubernetes", "-o", "json", "--quiet", "--compact",
                          "--skip-download"], capture_output=True, text=True)
    assert run.returncode in (0, 1), run.stderr
    reports = json.loads(run.stdout)
    failed = {}
    for report in reports if isinstance(reports, list) else [reports]:
        if report.get("check_type", "kubernetes") != "kubernetes":
            continue
        for f in report.get("results", {}).get("failed_checks", []):
            failed.setdefault(f["check_id"], set()).add(f"{os.path.basename(f['file_path'])}: {f['resource']}")
    return failed


def readme_checkov_exceptions():
    text = open(README).read()
    section = text[text.index("### checkov"):]
    section = section[:section.index("\n## ") if "\n## " in section else len(section)]
    return set(re.findall(r"^\| (CKV_K8S_\d+) \|", section, re.M))


def test_checkov_finds_only_what_the_readme_explains(tmp_path):
    pinned = {"image": {"digest": DIGEST}}
    modes = {m: {**v, **pinned} for m, v in MODES.items()}
    worker = modes["sidecar-real-worker"]["sidecar"]["worker"]
    modes["sidecar-real-worker"]["sidecar"] = {**modes["sidecar-real-worker"]["sidecar"],
                                              "worker": {**worker, "image": f"vllm/vllm-openai@{DIGEST}"}}
    modes["sidecar-tls-priority"] = {**pinned, "tls": {"secretName": "kv-tls"}, "priorityClassName": "kv-high"}
    failed = checkov_failures(modes, tmp_path)
    assert not (PROMISED & set(failed)), {k: sorted(failed[k]) for k in PROMISED & set(failed)}
    listed = readme_checkov_exceptions()
    assert set(failed) <= listed, {k: sorted(v) for k, v in failed.items() if k not in listed}
    assert listed <= set(failed), f"helm/README.md explains checks that no longer fail: {sorted(listed - set(failed))}"
    # Without a digest the digest check fails: the scan sees what it is asked to.
    assert "CKV_K8S_43" in checkov_failures({"sidecar": {}}, tmp_path / "nodigest")


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_namespaced_object_names_the_release_namespace(mode):
    for doc in render(MODES[mode], namespace="llm"):
        want = MODES[mode].get("grafanaDashboard", {}).get("namespace") if doc["metadata"]["name"].endswith(
            "-dashboard") else None
        assert doc["metadata"].get("namespace") == (want or "llm"), (doc["kind"], doc["metadata"]["name"])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def self_signed(directory):
    """A certificate for 127.0.0.1 and its key, as a kubernetes.io/tls Secret would hold them."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=karakvd",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(directory / "tls.key"),
                    "-out", str(directory / "tls.crt")], check=True, capture_output=True)


@pytest.mark.parametrize("mode", ["sidecar", "daemonset", "sidecar-tls", "daemonset-kv-events"])
def test_karakvd_accepts_the_config_and_the_probes_pass(mode, tmp_path):
    karakvd, cli = os.environ.get("KARAKVD"), os.environ.get("KARAKV_CLI")
    if not (karakvd and cli):
        pytest.skip("KARAKVD and KARAKV_CLI are not set (ctest sets them)")
    # The chart's defaults, with a small pool so the test is light; metrics off so no fixed port.
    values = {**MODES.get(mode, {}), "config": {"pool_bytes": "8MiB"}, "metrics": {"enabled": False}}
    tls_dir = tmp_path / "tls"
    if mode == "sidecar-tls":
        tls_dir.mkdir()
        self_signed(tls_dir)
        values["tls"] = {"secretName": "kv-tls", "port": free_port(), "clientCA": False}
    if mode == "daemonset-kv-events":
        values["mode"] = "daemonset"
        values["kvEvents"] = {"enabled": True, "port": free_port(), "replayPort": free_port()}
    docs = render(values)
    (cm,) = by_kind(docs, "ConfigMap")
    conf = cm["data"]["karakvd.conf"]
    assert "socket=/run/karakv/karakv.sock" in conf.splitlines()
    sock = str(tmp_path / "karakv.sock")
    (tmp_path / "karakvd.conf").write_text(
        conf.replace("/run/karakv/karakv.sock", sock).replace("/etc/karakv/tls", str(tls_dir)))
    daemon = daemon_container(pod_spec(docs))
    assert daemon["args"] == ["--config=/etc/karakv/karakvd.conf"]
    args = [karakvd, f"--config={tmp_path / 'karakvd.conf'}"]

    def command(probe):
        return [cli if a == "karakv" else a.replace("/run/karakv/karakv.sock", sock)
                for a in daemon[probe]["exec"]["command"]]

    probe, liveness = command("readinessProbe"), command("livenessProbe")
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
        alive = subprocess.run(liveness, capture_output=True, text=True)
        assert alive.returncode == 0 and alive.stdout.startswith("alive"), shlex.join(liveness) + ": " + alive.stderr
        if mode == "sidecar-tls":
            # A worker outside the pod: TLS on the chart's port, with the Secret's certificate.
            port = values["tls"]["port"]
            tls = subprocess.run([cli, f"--target=127.0.0.1:{port}", f"--tls_ca={tls_dir / 'tls.crt'}", "health"],
                                 capture_output=True, text=True)
            assert tls.returncode == 0 and tls.stdout.strip() == "SERVING", tls.stderr
            plain = subprocess.run([cli, f"--target=127.0.0.1:{port}", "--timeout=2", "health"], capture_output=True)
            assert plain.returncode != 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    # A stopped daemon fails both probes, so the probes can fail.
    assert subprocess.run(probe, capture_output=True).returncode != 0
    assert subprocess.run(liveness, capture_output=True).returncode != 0


# --- Monitoring: the job label, the rules, the dashboard -------------------------------------------

SELECTOR = re.compile(r'([A-Za-z_:][A-Za-z0-9_:]*)?\{([^{}]*)\}')
MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')


def selectors(expr):
    """The vector selectors of a PromQL expression: [(metric name or None, [(label, op, value)])].
    Enough PromQL for our rules and panels: selectors with braces, and a bare `up` (which would
    select every target of the cluster)."""
    out = []
    for m in SELECTOR.finditer(expr):
        matchers, rest = [], m.group(2)
        while rest.strip():
            mm = MATCHER.match(rest)
            assert mm, f"cannot parse the matchers {m.group(2)!r} of {expr!r}"
            matchers.append((mm.group(1), mm.group(2), mm.group(3).replace('\\\\', '\\')))
            rest = rest[mm.end():]
        out.append((m.group(1), matchers))
    if re.search(r'\bup\b(?!\s*\{)', expr):
        out.append(("up", []))
    return out


def matches(matchers, labels):
    """Prometheus semantics: a missing label is the empty string; regexes are anchored."""
    for name, op, value in matchers:
        have = labels.get(name, "")
        ok = {"=": have == value, "!=": have != value,
              "=~": re.fullmatch(value, have) is not None, "!~": re.fullmatch(value, have) is None}[op]
        if not ok:
            return False
    return True


def scraped_target(docs):
    """The target labels the Prometheus Operator gives karakvd's series, from the rendered
    ServiceMonitor or PodMonitor: job is the value of the object's jobLabel (a label of the Service,
    or of the pod), or when it has none the Service's name / "<namespace>/<PodMonitor name>"."""
    (monitor,) = by_kind(docs, "ServiceMonitor") + by_kind(docs, "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    (workload,) = by_kind(docs, "Deployment") + by_kind(docs, "DaemonSet")
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    job_label = monitor["spec"].get("jobLabel")
    if monitor["kind"] == "ServiceMonitor":
        (svc,) = [s for s in by_kind(docs, "Service") if selector.items() <= s["metadata"]["labels"].items()]
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        job = svc["metadata"]["labels"].get(job_label) or svc["metadata"]["name"]
        extra = {"service": svc["metadata"]["name"], "endpoint": "metrics"}
    else:
        assert selector.items() <= pod_labels.items()
        job = pod_labels.get(job_label) or f"llm/{monitor['metadata']['name']}"
        extra = {}
    # targetLabels (Service labels) and podTargetLabels (pod labels) are copied onto the series under
    # Prometheus-safe names.
    copied = {}
    source = svc["metadata"]["labels"] if monitor["kind"] == "ServiceMonitor" else pod_labels
    for name in monitor["spec"].get("targetLabels", []) + monitor["spec"].get("podTargetLabels", []):
        if name in source:
            copied[re.sub(r"[^a-zA-Z0-9_]", "_", name)] = source[name]
    return {"job": job, "namespace": "llm", "pod": workload["metadata"]["name"] + "-7d9f8-x2k4q",
            "container": "karakvd", "instance": "10.1.2.3:9464", **extra, **copied}


def dashboard_from(docs):
    (cm,) = [c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    return json.loads(cm["data"]["karakv.json"])


def dashboard_exprs(dash):
    def walk(panels):
        for p in panels:
            yield from ((p["title"], t["expr"]) for t in p.get("targets", []))
            yield from walk(p.get("panels", []))
    return list(walk(dash["panels"]))


def grafana_interpolate(dash, expr, target):
    """What Grafana sends for expr on a fresh load: each query variable takes the first value its
    label_values(metric{...}, label) finds on the target's series, or All (allValue) when it has
    All; $__rate_interval becomes a range."""
    chosen = {}
    for v in dash["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r'label_values\((\w+)(\{.*\})?, (\w+)\)', v["definition"])
        assert m, v["definition"]
        sel = m.group(2) or "{}"
        for name, value in chosen.items():
            sel = sel.replace(f"${name}", value)
        found = [target[m.group(3)]] if m.group(3) in target and matches(selectors(sel)[0][1], target) else []
        if v.get("includeAll"):
            chosen[v["name"]] = v["allValue"]
        else:
            assert found, f"variable {v['name']}: {v['definition']} finds nothing on {target}"
            chosen[v["name"]] = found[0]
    for name, value in sorted(chosen.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(f"${name}", value)
    expr = expr.replace("$__rate_interval", "1m")
    assert "$" not in expr, expr
    return expr


def check_selects_the_target(exprs, target):
    """Every `up` selector, and every selector with a job matcher, matches the target's labels
    (its matchers on other labels, code or policy, are not the monitor's business); `up` always has
    a job matcher (a bare one would select every target of the cluster)."""
    checked = 0
    for where, expr in exprs:
        for metric, matchers in selectors(expr):
            has_job = any(name == "job" for name, _, _ in matchers)
            if metric == "up":
                assert has_job, f"{where}: {expr} selects up of every job"
            if has_job:
                on_target = [m for m in matchers if m[0] in target]
                assert matches(on_target, target), f"{where}: {expr} does not select job={target['job']!r}"
                checked += 1
    return checked


MONITORS = {"servicemonitor": {"serviceMonitor": {"enabled": True}}, "podmonitor": {"podMonitor": {"enabled": True}}}


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
@pytest.mark.parametrize("monitor", sorted(MONITORS))
@pytest.mark.parametrize("names", [{}, {"nameOverride": "kvcache"}, {"fullnameOverride": "llama-kv"}])
def test_rules_and_dashboard_select_the_job_the_monitor_produces(mode, monitor, names):
    docs = render({"mode": mode, **MONITORS[monitor], **names,
                   "prometheusRule": {"enabled": True}, "grafanaDashboard": {"enabled": True}})
    target = scraped_target(docs)
    assert target["job"] == names.get("nameOverride", "karakv")
    assert target["app_kubernetes_io_instance"] == "kv"  # the release, which the rules select too
    (rule,) = by_kind(docs, "PrometheusRule")
    rules = [(r["alert"], r["expr"]) for g in rule["spec"]["groups"] for r in g["rules"]]
    assert check_selects_the_target(rules, target) >= 1  # KarakvDown's up{job=...}
    dash = dashboard_from(docs)
    panels = [(title, grafana_interpolate(dash, e, target)) for title, e in dashboard_exprs(dash)]
    # Every panel filters by job (all four variables, below), so all of them are checked here.
    assert check_selects_the_target(panels, target) == sum(len(selectors(e)) for _, e in panels)


def test_job_check_catches_a_monitor_without_job_label():
    # Without jobLabel the operator names the job after the Service ("kv-karakv-metrics") or the
    # PodMonitor ("llm/kv-karakv"): KarakvDown and the dashboard would then select nothing.
    for monitor in MONITORS.values():
        docs = render({**monitor, "prometheusRule": {"enabled": True}, "grafanaDashboard": {"enabled": True}})
        (mon,) = by_kind(docs, "ServiceMonitor") + by_kind(docs, "PodMonitor")
        del mon["spec"]["jobLabel"]
        target = scraped_target(docs)
        assert target["job"] in ("kv-karakv-metrics", "llm/kv-karakv")
        (rule,) = by_kind(docs, "PrometheusRule")
        with pytest.raises(AssertionError, match="does not select job="):
            check_selects_the_target([(r["alert"], r["expr"]) for g in rule["spec"]["groups"] for r in g["rules"]],
                                     target)
        # The dashboard assumes no job name: its $job lists the jobs of karakv's series, whatever
        # they are called.
        dash = dashboard_from(docs)
        panels = [(title, grafana_interpolate(dash, e, target)) for title, e in dashboard_exprs(dash)]
        assert check_selects_the_target(panels, target) > 20


def test_selector_parser():
    (sel,) = selectors('sum(rate(x_total{code=~"A|B", job="kv"}[5m])) > 0')
    assert sel == ("x_total", [("code", "=~", "A|B"), ("job", "=", "kv")])
    assert matches(sel[1], {"code": "B", "job": "kv"}) and not matches(sel[1], {"code": "AB", "job": "kv"})
    assert selectors("up == 0") == [("up", [])]
    assert matches([("namespace", "=~", ".*")], {}) and not matches([("job", "=", "karakv")], {})


def test_prometheusrule_is_deploy_alerts_with_the_charts_job():
    with open(ALERTS) as f:
        text = f.read()
    assert 'up{job="karakv"}' in text
    for names, job in [({}, "karakv"), ({"nameOverride": "kvcache"}, "kvcache")]:
        docs = render({"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True,
                       "labels": {"release": "prom"}}, **names})
        (rule,) = by_kind(docs, "PrometheusRule")
        assert rule["apiVersion"] == "monitoring.coreos.com/v1"
        assert rule["metadata"]["labels"]["release"] == "prom"
        expected = yaml.safe_load(
            text.replace('job="karakv"', f'job="{job}",namespace="llm",app_kubernetes_io_instance="kv"'))
        assert rule["spec"]["groups"] == expected["groups"]
        assert len(expected["groups"][0]["rules"]) >= 8
    assert not by_kind(render({}), "PrometheusRule")


def test_two_releases_alert_only_on_their_own_daemons(tmp_path):
    """Two releases of the chart in one namespace, both scraped by one Prometheus with the same job:
    promtool evaluates both releases' rules over both daemons' series (the labels the monitors
    give them), and each alert fires once, for the release whose daemon it is about."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found (scripts/setup.sh installs Debian's prometheus package)")
    files = []
    for release in ("kv", "kv2"):
        docs = render({"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}, name=release)
        (rule,) = by_kind(docs, "PrometheusRule")
        path = tmp_path / f"{release}.yml"
        path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        files.append(path.name)

    def series(metric, release, values):
        labels = (f'namespace="llm",pod="{release}-worker-0",job="karakv",instance="10.0.0.{len(release)}:9464",'
                  f'app_kubernetes_io_instance="{release}"')
        return {"series": f"{metric}{{{labels}}}", "values": values}

    down_labels = {"severity": "critical", "namespace": "llm", "pod": "kv2-worker-0", "job": "karakv",
                   "instance": "10.0.0.3:9464", "app_kubernetes_io_instance": "kv2"}
    tests = {"rule_files": files, "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [series("up", "kv", "1x10"), series("up", "kv2", "1 1 0 0 0 0 0 0 0 0"),
                         series("karakv_lease_expiries_total", "kv", "0+1x10"),
                         series("karakv_lease_expiries_total", "kv2", "0x10")],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "KarakvDown", "exp_alerts": [{
                "exp_labels": down_labels,
                "exp_annotations": {
                    "summary": "karakvd 10.0.0.3:9464 is not answering scrapes",
                    "description": "Prometheus could not scrape /metrics for 1 minute: the daemon is down or "
                                   "--metrics_listen is wrong. Workers on this node lose their KV cache."}}]},
            {"eval_time": "9m", "alertname": "KarakvAbsent", "exp_alerts": []},
            {"eval_time": "9m", "alertname": "KarakvLeaseExpiries", "exp_alerts": [{
                "exp_labels": {**down_labels, "severity": "warning", "pod": "kv-worker-0",
                               "instance": "10.0.0.2:9464", "app_kubernetes_io_instance": "kv"},
                "exp_annotations": {
                    "summary": "workers of karakvd 10.0.0.2:9464 keep losing their sessions",
                    "description": "9 sessions expired in 10 minutes: workers crash or stop sending heartbeats "
                                   "(their blocks were freed)."}}]},
        ]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(tests))
    r = subprocess.run([promtool, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def chart_files(chart):
    return {f["name"]: f["data"] for f in chart.files}


def test_chart_files_are_deploys_and_survive_packaging(tmp_path):
    # files/alerts.yml and files/karakv-dashboard.json are symbolic links into deploy/: Helm's loader
    # follows them, and `helm package` stores their contents, so a published chart carries the files.
    with open(ALERTS) as f:
        alerts = f.read()
    with open(DASHBOARD) as f:
        dashboard = f.read()
    for name, target in [("alerts.yml", ALERTS), ("karakv-dashboard.json", DASHBOARD)]:
        link = os.path.join(CHART, "files", name)
        assert os.path.islink(link) and os.path.samefile(link, target), f"{link} is not a link to {target}"
    with helm.Chart.load(CHART) as chart:
        files = chart_files(chart)
        archive = chart.save(tmp_path)
    assert files["files/alerts.yml"] == alerts and files["files/karakv-dashboard.json"] == dashboard
    with open(archive, "rb") as f, helm.Chart.load_archive(f.read()) as packaged:
        assert chart_files(packaged)["files/karakv-dashboard.json"] == dashboard
        out = packaged.render({"grafanaDashboard": {"enabled": True}}, name="kv", namespace="llm")
    (cm,) = [d for d in yaml.safe_load_all(out["karakv/templates/grafana-dashboard.yaml"]) if d]
    assert json.loads(cm["data"]["karakv.json"]) == release_dashboard(json.loads(dashboard), "llm", "kv")


def release_dashboard(dash, namespace, release):
    """The dashboard as the chart ships it for a release: the file's, with its own uid ("karakv-" and
    12 hex digits of the sha256 of "<namespace>/<release>") and a title naming the release."""
    ident = f"{namespace}/{release}"
    return {**dash, "uid": "karakv-" + hashlib.sha256(ident.encode()).hexdigest()[:12],
            "title": f"{dash['title']} ({ident})"}


def test_dashboard_configmap_for_the_grafana_sidecar():
    docs = render({"grafanaDashboard": {"enabled": True, "namespace": "monitoring",
                                        "annotations": {"grafana_folder": "LLM serving"}}})
    # In Grafana's namespace the name carries the release's namespace: releases "kv" of two
    # namespaces would clash there otherwise.
    (cm,) = [c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"] == "kv-karakv-llm-dashboard"]
    (other,) = [c for c in by_kind(render({"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}},
                                          namespace="staging"), "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    assert other["metadata"]["name"] == "kv-karakv-staging-dashboard"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}
    with open(DASHBOARD) as f:
        dash = json.load(f)
    # The file's dashboard, all of it but the uid and title, which are the release's (the file's
    # own uid "karakv" is for a standalone import).
    assert dash["uid"] == "karakv" and dash["title"] == "karakv"
    shipped = json.loads(cm["data"]["karakv.json"])
    assert shipped == release_dashboard(dash, "llm", "kv")
    assert shipped["uid"] == "karakv-92e5e8374a2e" and shipped["title"] == "karakv (llm/kv)"
    (cm,) = [c for c in by_kind(render({"grafanaDashboard": {"enabled": True}}), "ConfigMap")
             if c["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["namespace"] == "llm" and cm["metadata"]["name"] == "kv-karakv-dashboard"
    assert [c["metadata"]["name"] for c in by_kind(render({}), "ConfigMap")] == ["kv-karakv-config"]


def test_two_releases_get_their_own_dashboard():
    """Grafana keys dashboards by uid (at most 40 characters, letters, digits, - and _): two
    releases' ConfigMaps with one uid would replace each other in a Grafana that loads both, so each
    release's uid is its own, whether the names or the namespaces differ; an upgrade keeps it."""
    releases = [("llm", "kv"), ("llm", "kv2"), ("staging", "kv"), ("llm", "llama-70b-kvcache-" + "x" * 35)]
    uids = {}
    for namespace, release in releases:
        dash = dashboard_from(render({"grafanaDashboard": {"enabled": True}}, name=release, namespace=namespace))
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dash["uid"]), dash["uid"]
        assert dash["title"] == f"karakv ({namespace}/{release})"
        uids[namespace, release] = dash["uid"]
    assert len(set(uids.values())) == len(releases), uids
    assert "karakv" not in uids.values()
    # The ConfigMap in another namespace (Grafana's) does not change it: the uid is the release's.
    dash = dashboard_from(render({"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}}))
    assert dash["uid"] == uids["llm", "kv"]


AGGREGATION = re.compile(r'\b(sum|avg|min|max|count|group|stddev|stdvar|topk|bottomk|quantile)\s*'
                         r'(?:by\s*\(([^()]*)\))?\s*\(')


def legend_labels(expr):
    """The labels a panel query's series keep: those of every aggregation's `by`, or None for the
    labels of the selected series (no aggregation)."""
    kept = None
    for m in AGGREGATION.finditer(expr):
        group = {l.strip() for l in (m.group(2) or "").split(",") if l.strip()}
        kept = group if kept is None else kept & group
    return kept


def test_dashboard_has_the_kubernetes_variables_and_panels():
    with open(DASHBOARD) as f:
        dash = json.load(f)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"job", "namespace", "pod", "instance"} <= set(variables)
    for name in ("namespace", "pod", "instance"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    exprs = dashboard_exprs(dash)
    for title, expr in exprs:
        for metric, matchers in selectors(expr):
            got = {(n, op, v) for n, op, v in matchers}
            want = {(n, "=~", f"${n}") for n in ("job", "namespace", "pod", "instance")}
            assert want <= got, f"panel {title!r}: {metric} is not filtered by every variable: {expr}"
    assert 'job="karakv"' not in json.dumps(dash)
    by_title = {}
    for title, expr in exprs:
        by_title.setdefault(title, []).append(expr)
    metrics = {t: {m for e in es for m, _ in selectors(e)} for t, es in by_title.items()}
    assert "karakv_preemptions_total" in metrics["Preemptions"]
    assert {"karakv_prefix_hit_tokens_total", "karakv_prefix_lookup_tokens_total"} <= metrics["Prefix hit rate"]
    assert {"karakv_decode_commands_total", "karakv_ring_wakeups_total"} <= metrics["Ring traffic"]
    assert any('path="ring"' in e for e in by_title["Ring traffic"])
    assert by_title["KV blocks by tenant"] == [
        'sum by (tenant) (karakv_tenant_blocks_in_use{job=~"$job",namespace=~"$namespace",pod=~"$pod",'
        'instance=~"$instance"})']
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))

    # No panel overlaps another (Grafana would push one down); all fit the 24 columns.
    boxes = [(p["title"], p["gridPos"]) for p in dash["panels"]]
    for i, (title, a) in enumerate(boxes):
        assert a["x"] >= 0 and a["x"] + a["w"] <= 24, title
        for other, b in boxes[i + 1:]:
            apart = (a["x"] + a["w"] <= b["x"] or b["x"] + b["w"] <= a["x"] or
                     a["y"] + a["h"] <= b["y"] or b["y"] + b["h"] <= a["y"])
            assert apart, f"panels {title!r} and {other!r} overlap: {a} {b}"

    # Legends name the pod, not its IP:port: {{instance}} only where the query has no pod label;
    # an aggregation that keeps instance keeps namespace and pod; no selector repeats a matcher.
    panels = [p for p in dash["panels"]] + [c for p in dash["panels"] for c in p.get("panels", [])]
    for p in panels:
        for t in p.get("targets", []):
            expr, legend = t["expr"], t.get("legendFormat", "")
            for m in AGGREGATION.finditer(expr):
                group = {l.strip() for l in (m.group(2) or "").split(",")}
                assert "instance" not in group or {"namespace", "pod"} <= group, f"{p['title']!r}: {expr}"
            kept = legend_labels(expr)
            used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
            assert kept is None or used <= kept, f"{p['title']!r}: legend {legend!r} names labels {expr} drops"
            if kept is None or "pod" in kept:
                assert "instance" not in used, f"{p['title']!r}: legend {legend!r} shows the pod's IP, not its name"
            for metric, matchers in selectors(expr):
                names = [n for n, _, _ in matchers]
                assert len(names) == len(set(names)), f"{p['title']!r}: {metric} repeats a matcher: {expr}"
    assert legend_labels('sum by (le, instance) (rate(x[1m]))') == {"le", "instance"}
    assert legend_labels('sum(rate(x[1m]))') == set() and legend_labels('x{a="b"}') is None

    # Memory, prefix evictions and build.
    by_panel = {p["title"]: p for p in panels}
    heap = by_panel["Heap against the memory limit"]
    assert metrics["Heap against the memory limit"] == {
        "karakv_heap_in_use_bytes", "karakv_heap_held_bytes", "karakv_memory_limit_bytes"}
    assert heap["type"] == "timeseries" and heap["fieldConfig"]["defaults"]["unit"] == "bytes"
    (limit,) = [t for t in heap["targets"] if "karakv_memory_limit_bytes" in t["expr"]]
    (override,) = heap["fieldConfig"]["overrides"]  # the limit: a dashed line, not filled
    assert override["matcher"] == {"id": "byFrameRefID", "options": limit["refId"]}
    props = {o["id"]: o["value"] for o in override["properties"]}
    assert props["custom.lineStyle"]["fill"] == "dash" and props["custom.fillOpacity"] == 0
    assert metrics["Prefix-cache evictions"] == {"karakv_prefix_evictions_total"}
    (evictions,) = by_title["Prefix-cache evictions"]
    assert "rate(karakv_prefix_evictions_total{" in evictions and "pod" in legend_labels(evictions)
    build = by_panel["Build info"]
    assert metrics["Build info"] == {"karakv_build_info"}
    assert build["type"] == "table" and build["targets"][0]["format"] == "table" and build["targets"][0]["instant"]
    (shown,) = [t["options"]["include"]["names"] for t in build["transformations"] if t["id"] == "filterFieldsByName"]
    assert {"pod", "version", "revision", "backend"} <= set(shown)  # server/metrics.cc's labels, by pod


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_podmonitor_scrapes_the_pods(mode):
    docs = render({"mode": mode, "podMonitor": {"enabled": True, "labels": {"release": "prom"},
                                                 "interval": "30s"}})
    assert not by_kind(docs, "ServiceMonitor")
    (pm,) = by_kind(docs, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["labels"]["release"] == "prom"
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["llm"]}
    (workload,) = by_kind(docs, "Deployment") + by_kind(docs, "DaemonSet")
    assert pm["spec"]["selector"]["matchLabels"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}
    ports = {p["name"]: p["containerPort"] for p in daemon_container(pod_spec(docs))["ports"]}
    assert ports["metrics"] == 9464
    assert not by_kind(render({"mode": mode}), "PodMonitor")


def test_networkpolicy_opens_only_metrics_and_extra_ingress():
    docs = render(MODES["daemonset-servicemonitor-rules-dashboard-netpol"])
    (np,) = by_kind(docs, "NetworkPolicy")
    (ds,) = by_kind(docs, "DaemonSet")
    assert np["spec"]["podSelector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert np["spec"]["policyTypes"] == ["Ingress"]
    assert np["spec"]["ingress"] == [{
        "ports": [{"port": 9464, "protocol": "TCP"}],
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}]
    # The gRPC probe's port serves the whole API: the policy does not open it.
    (np,) = by_kind(render({"networkPolicy": {"enabled": True}, "probes": {"type": "grpc"}}), "NetworkPolicy")
    assert np["spec"]["ingress"] == [{"ports": [{"port": 9464, "protocol": "TCP"}]}]
    (np,) = by_kind(render({"networkPolicy": {"enabled": True}, "metrics": {"enabled": False}}), "NetworkPolicy")
    assert np["spec"]["ingress"] == []  # nothing in
    (np,) = by_kind(render(REAL_WORKER), "NetworkPolicy")
    assert {"ports": [{"port": "http", "protocol": "TCP"}]} in np["spec"]["ingress"]
    assert not by_kind(render({}), "NetworkPolicy")


@pytest.mark.parametrize("mode", sorted(MODES))
def test_scrape_ports_are_numbers_that_need_no_name_resolution(mode):
    """The metrics Service's targetPort and every NetworkPolicy port the scrape needs are numbers
    equal to karakvd's container port: named ports of init containers (the native sidecar) resolve
    for Service endpoints only from Kubernetes 1.32, and not in every network plugin."""
    values = dict(MODES[mode])
    values["networkPolicy"] = {"enabled": True}
    values["metrics"] = {"enabled": True, "port": 9555}
    docs = render(values)
    ports = {p["name"]: p["containerPort"] for p in daemon_container(pod_spec(docs))["ports"]}
    assert ports["metrics"] == 9555
    (svc,) = by_kind(docs, "Service")
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(9555, 9555)]
    (np,) = by_kind(docs, "NetworkPolicy")
    scrape = [p for rule in np["spec"]["ingress"] for p in rule.get("ports", [])]
    assert scrape == [{"port": 9555, "protocol": "TCP"}]


def test_name_overrides():
    docs = render({"nameOverride": "kvcache", "serviceMonitor": {"enabled": True}})
    names = {d["kind"]: d["metadata"]["name"] for d in docs}
    assert names["Deployment"] == "kv-kvcache-worker" and names["Service"] == "kv-kvcache-metrics"
    assert all(d["metadata"]["labels"]["app.kubernetes.io/name"] == "kvcache" for d in docs)
    docs = render({"fullnameOverride": "llama-kv", "mode": "daemonset"})
    names = {d["kind"]: d["metadata"]["name"] for d in docs}
    assert names == {"ConfigMap": "llama-kv-config", "DaemonSet": "llama-kv", "Service": "llama-kv-metrics",
                     "ServiceAccount": "llama-kv"}
    (ds,) = by_kind(docs, "DaemonSet")
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "llama-kv-config"
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == "llama-kv"


def test_real_worker_gets_its_ports_probes_volumes_and_security_context():
    docs = render(REAL_WORKER)
    spec = pod_spec(docs)
    (worker,) = spec["containers"]
    w = REAL_WORKER["sidecar"]["worker"]
    assert worker["name"] == "vllm" and worker["ports"] == w["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe] == w[probe]
    assert mounts(worker) == {"karakv-socket": "/run/karakv", "dshm": "/dev/shm", "weights": "/models",
                              "cache": "/home/worker/.cache"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["weights"]["persistentVolumeClaim"]["claimName"] == "llama-weights"
    assert volumes["cache"]["emptyDir"] == {"sizeLimit": "10Gi"}
    assert {"karakv-socket", "dshm", "config"} <= set(volumes)
    sc = worker["securityContext"]
    # The override's keys replace the chart's, which stay where not overridden.
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == daemon_container(spec)["securityContext"]["runAsUser"] == 10001
    assert worker["resources"]["limits"] == {"nvidia.com/gpu": 1}
    (worker,) = pod_spec(render({"sidecar": {"worker": {"securityContext": {"readOnlyRootFilesystem": False}}}}))[
        "containers"]
    assert worker["securityContext"]["readOnlyRootFilesystem"] is False
    assert worker["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # The default example worker: no ports, no probes, only the chart's mounts.
    (worker,) = pod_spec(render({}))["containers"]
    assert not {"ports", "startupProbe", "livenessProbe", "readinessProbe"} & set(worker)
    assert set(mounts(worker)) == {"karakv-socket", "dshm"}


def test_broken_links_fail_rendering(tmp_path):
    # A checkout without symbolic links has the link's target path as the file's text.
    chart = shutil.copytree(CHART, tmp_path / "karakv")
    for name in ("alerts.yml", "karakv-dashboard.json"):
        (chart / "files" / name).write_text(os.readlink(os.path.join(CHART, "files", name)))
    with helm.Chart.load(chart) as c:
        with pytest.raises(helm.HelmError, match="link to deploy/prometheus/alerts.yml broken"):
            c.render({"prometheusRule": {"enabled": True}}, name="kv", namespace="llm")
        with pytest.raises(helm.HelmError, match="link to deploy/grafana/karakv-dashboard.json broken"):
            c.render({"grafanaDashboard": {"enabled": True}}, name="kv", namespace="llm")
