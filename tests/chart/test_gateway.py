"""The gateway's objects (`gateway.enabled`): off, nothing of it; on, its Deployment runs
`trtllm-worker gateway` from the workers' image and ConfigMap, on its own port and probes,
with the API keys from a Secret mounted as a folder, and its Service, PodDisruptionBudget,
Ingress, HorizontalPodAutoscaler, NetworkPolicy and ServiceMonitor as switched on. No
selector of the workers selects its pods, nor the other way round."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

import helm_python
import pytest

from tests.chart.support import (
    ALL_ON,
    CHART_SECRET,
    EXISTING_SECRET,
    FULLNAME,
    GATEWAY,
    Manifest,
    Rendered,
    chart,
    merge,
    render,
    render_error,
)
from trtllm_worker.gateway.keys import Caller, KeyRing

ON: dict[str, Any] = merge(CHART_SECRET, {"gateway": {"enabled": True}})
KEYS = merge(ON, {"gateway": {"apiKeys": {"existingSecret": "gateway-keys"}}})
GATEWAY_KINDS = {
    "Deployment",
    "Service",
    "PodDisruptionBudget",
    "Ingress",
    "HorizontalPodAutoscaler",
    "NetworkPolicy",
    "ServiceMonitor",
}


@pytest.fixture(scope="module")
def on() -> Rendered:
    return render(ON)


@pytest.fixture(scope="module")
def all_on() -> Rendered:
    return render(ALL_ON)


def gateway_pod(rendered: Rendered) -> Manifest:
    return cast(Manifest, rendered.one("Deployment", GATEWAY)["spec"]["template"])


def gateway_container(rendered: Rendered) -> Manifest:
    containers = gateway_pod(rendered)["spec"]["containers"]
    assert [c["name"] for c in containers] == ["gateway"]
    return cast(Manifest, containers[0])


def gateway_env(rendered: Rendered) -> dict[str, Manifest]:
    return {e["name"]: e for e in gateway_container(rendered)["env"]}


def schema_error(values: dict[str, Any]) -> str:
    try:
        chart().validate_schema(chart().merge_values(values))
    except helm_python.HelmValuesError as exc:
        return str(exc)
    raise AssertionError(f"the schema accepted {values}")


# -- off and on -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        CHART_SECRET,
        EXISTING_SECRET,
        merge(ALL_ON, {"gateway": {"enabled": False}}),
    ],
    ids=["default", "existing", "all-on-but-the-gateway"],
)
def test_off_renders_nothing_of_it(values: dict[str, Any]) -> None:
    assert chart().values["gateway"]["enabled"] is False
    rendered = render(values)
    for manifest in rendered.manifests:
        assert "gateway" not in manifest["metadata"]["name"], manifest["kind"]
        labels = manifest["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == "worker", manifest["kind"]
    assert "gateway" not in rendered.notes
    # the ConfigMap carries the gateway's settings all the same (one ConfigMap, two roles)
    assert rendered.config["WORKER_GATEWAY_PORT"] == "8000"


def test_on_adds_a_deployment_a_service_and_a_budget(on: Rendered) -> None:
    gateway = sorted(m["kind"] for m in on.manifests if m["metadata"]["name"] == GATEWAY)
    assert gateway == ["Deployment", "PodDisruptionBudget", "Service"]
    for manifest in on.manifests:
        if manifest["metadata"]["name"] == GATEWAY:
            labels = manifest["metadata"]["labels"]
            assert labels["app.kubernetes.io/component"] == "gateway"
            assert labels["app.kubernetes.io/part-of"] == "trtllm-worker"
            assert labels["app.kubernetes.io/instance"] == "demo"
    # the workers are as they were
    assert render(CHART_SECRET).deployment == on.deployment


def test_every_gateway_object_when_all_is_on(all_on: Rendered) -> None:
    named = {m["kind"] for m in all_on.manifests if m["metadata"]["name"] == GATEWAY}
    assert named == GATEWAY_KINDS


# -- the Deployment ---------------------------------------------------------------------------


def test_the_gateway_command_image_and_settings(on: Rendered) -> None:
    container = gateway_container(on)
    # the image's ENTRYPOINT is `dumb-init ... trtllm-worker`: the worker passes ["serve"]
    assert container["args"] == ["gateway"]
    assert on.container["args"] == ["serve"]
    assert container["image"] == on.container["image"] == "trtllm-worker:0.1.0"
    assert container["envFrom"] == on.container["envFrom"] == [{"configMapRef": {"name": FULLNAME}}]
    env = gateway_env(on)
    worker_env = on.env()
    for name in ("WORKER_AMQP_URL", "WORKER_REDIS_URL", "WORKER_REDIS_SENTINEL_PASSWORD"):
        assert env[name] == worker_env[name], name
    assert "WORKER_GATEWAY_KEYS_FILE" not in env  # no keys given: the gateway is open
    assert "WARNING: the gateway has no API keys" in on.notes
    assert on.one("Deployment", GATEWAY)["spec"]["replicas"] == 2


def test_port_and_probes(on: Rendered) -> None:
    container = gateway_container(on)
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert on.config["WORKER_GATEWAY_PORT"] == "8000"
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["livenessProbe"]["successThreshold"] == 1
    # the gateway starts in a second: no startupProbe
    assert "startupProbe" not in container
    service = on.one("Service", GATEWAY)["spec"]
    assert service["type"] == "ClusterIP"
    assert service["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]


def test_the_port_follows_the_setting() -> None:
    rendered = render(merge(ON, {"config": {"WORKER_GATEWAY_PORT": 9000}}))
    assert gateway_container(rendered)["ports"][0]["containerPort"] == 9000
    assert rendered.config["WORKER_GATEWAY_PORT"] == "9000"
    # the Service's port is its own; it targets the container's port by name
    assert rendered.one("Service", GATEWAY)["spec"]["ports"][0]["port"] == 8000


def test_probes_can_be_switched_off() -> None:
    off = {"enabled": False}
    rendered = render(merge(ON, {"gateway": {"livenessProbe": off, "readinessProbe": off}}))
    assert not {"livenessProbe", "readinessProbe"} & set(gateway_container(rendered))


def test_no_gpu_and_the_workers_security_context(on: Rendered) -> None:
    pod = gateway_pod(on)["spec"]
    container = gateway_container(on)
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert container["resources"] == {
        "requests": {"cpu": "500m", "memory": "256Mi"},
        "limits": {"memory": "1Gi"},
    }
    assert "tolerations" not in pod  # not the GPU taint's
    assert "runtimeClassName" not in pod
    assert pod["securityContext"] == on.pod_spec["securityContext"]
    assert container["securityContext"] == on.container["securityContext"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == on.pod_spec["serviceAccountName"]
    # uploads are spooled to /tmp: writable although the root is not
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tmp"]["emptyDir"] == {}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_restricted_pod_security_standard(all_on: Rendered) -> None:
    spec = gateway_pod(all_on)["spec"]
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(spec)
    context = gateway_container(all_on)["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["runAsNonRoot"] is True
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert all("hostPort" not in port for port in gateway_container(all_on)["ports"])


def test_grace_period_covers_the_drain(on: Rendered) -> None:
    # open answers run on for WORKER_DRAIN_TIMEOUT_S after SIGTERM
    assert gateway_pod(on)["spec"]["terminationGracePeriodSeconds"] == 30 + 10
    longer = render(merge(ON, {"config": {"WORKER_DRAIN_TIMEOUT_S": 120.5}}))
    assert gateway_pod(longer)["spec"]["terminationGracePeriodSeconds"] == 121 + 10


def test_rollout_keeps_every_replica_serving(on: Rendered) -> None:
    assert on.one("Deployment", GATEWAY)["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }


def test_extras_reach_the_gateway_pod(all_on: Rendered) -> None:
    pod = gateway_pod(all_on)
    spec = pod["spec"]
    assert pod["metadata"]["annotations"]["example.com/owner"] == "ml-platform"
    assert pod["metadata"]["labels"]["cost-center"] == "llm"
    assert pod["metadata"]["labels"]["team"] == "ml"  # commonLabels
    assert spec["nodeSelector"] == {"node-role.example.com/cpu": "true"}
    assert spec["imagePullSecrets"] == [{"name": "registry-pull"}]
    assert "initContainers" not in spec  # the workers' (a model download) are theirs
    assert gateway_env(all_on)["WEB_CONCURRENCY"] == {"name": "WEB_CONCURRENCY", "value": "1"}
    assert {v["name"]: v for v in spec["volumes"]}["tmp"]["emptyDir"] == {"sizeLimit": "2Gi"}
    # the workers' tracing variables are the workers'
    assert not [name for name in gateway_env(all_on) if name.startswith("OTEL_")]


# -- image ------------------------------------------------------------------------------------


def test_image_is_the_workers_unless_given() -> None:
    digest = "sha256:" + "ab" * 32
    worker = {"image": {"registry": "r.example.com", "repository": "ml/w", "digest": digest}}
    same = render(merge(ON, worker))
    assert gateway_container(same)["image"] == f"r.example.com/ml/w@{digest}"
    # a tag of its own (the slim cpu image): the workers' registry and repository, no digest
    cpu = render(merge(ON, merge(worker, {"gateway": {"image": {"tag": "0.1.0-cpu"}}})))
    assert gateway_container(cpu)["image"] == "r.example.com/ml/w:0.1.0-cpu"
    assert cpu.container["image"] == f"r.example.com/ml/w@{digest}"
    other = {"gateway": {"image": {"repository": "ml/gw", "digest": "sha256:" + "cd" * 32}}}
    own = render(merge(ON, merge(worker, other)))
    assert gateway_container(own)["image"] == "r.example.com/ml/gw@sha256:" + "cd" * 32


# -- API keys ---------------------------------------------------------------------------------


def test_keys_secret_is_mounted_as_a_folder() -> None:
    rendered = render(KEYS)
    volumes = {v["name"]: v for v in gateway_pod(rendered)["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"] == {"secretName": "gateway-keys", "defaultMode": 0o440}
    mounts = {m["name"]: m for m in gateway_container(rendered)["volumeMounts"]}
    # no subPath: Kubernetes updates a Secret volume's files only without one
    assert mounts["api-keys"] == {
        "name": "api-keys",
        "mountPath": "/etc/trtllm-worker/gateway-keys",
        "readOnly": True,
    }
    assert gateway_env(rendered)["WORKER_GATEWAY_KEYS_FILE"] == {
        "name": "WORKER_GATEWAY_KEYS_FILE",
        "value": "/etc/trtllm-worker/gateway-keys/keys.json",
    }
    assert "WARNING: the gateway has no API keys" not in rendered.notes
    assert "Bearer" in rendered.notes
    # the Secret is the operator's: the chart makes none, and reads none of it
    assert [m["metadata"]["name"] for m in rendered.all("Secret")] == [FULLNAME]
    # nothing of the keys in the workers' pods
    assert "api-keys" not in rendered.volumes()


def test_keys_file_key_and_folder_are_values() -> None:
    values = merge(
        ON,
        {"gateway": {"apiKeys": {"existingSecret": "k", "key": "api.json", "mountPath": "/keys/"}}},
    )
    rendered = render(values)
    assert gateway_env(rendered)["WORKER_GATEWAY_KEYS_FILE"]["value"] == "/keys/api.json"


def test_keys_from_a_file_of_ones_own() -> None:
    values = merge(
        ON,
        {
            "config": {"WORKER_GATEWAY_KEYS_FILE": "/etc/keys/keys.json"},
            "gateway": {
                "extraVolumes": [{"name": "keys", "csi": {"driver": "secrets-store.csi.k8s.io"}}],
                "extraVolumeMounts": [{"name": "keys", "mountPath": "/etc/keys"}],
            },
        },
    )
    rendered = render(values)
    assert rendered.config["WORKER_GATEWAY_KEYS_FILE"] == "/etc/keys/keys.json"
    assert "WORKER_GATEWAY_KEYS_FILE" not in gateway_env(rendered)
    volumes = {v["name"] for v in gateway_pod(rendered)["spec"]["volumes"]}
    assert volumes == {"tmp", "keys"}
    assert "WARNING: the gateway has no API keys" not in rendered.notes


def test_keys_from_a_secret_or_a_file_not_both() -> None:
    values = merge(KEYS, {"config": {"WORKER_GATEWAY_KEYS_FILE": "/etc/keys.json"}})
    message = render_error(values)
    assert "gateway.apiKeys.existingSecret" in message
    assert "not both" in message


def _publish(folder: Path, version: str, keys: dict[str, Any]) -> None:
    """Write as the kubelet updates a Secret volume: the files in a new timestamped
    folder, then the `..data` symlink swapped to it in one rename; each key is a symlink
    `<key> -> ..data/<key>`."""
    data = folder / f"..{version}"
    data.mkdir()
    (data / "keys.json").write_text(json.dumps(keys), encoding="utf-8")
    link = folder / "..data_tmp"
    link.symlink_to(data.name)
    os.replace(link, folder / "..data")
    if not (folder / "keys.json").is_symlink():
        (folder / "keys.json").symlink_to("..data/keys.json")


def test_the_mounted_folder_is_read_again_when_the_secret_changes(tmp_path: Path) -> None:
    # the path the chart gives WORKER_GATEWAY_KEYS_FILE, in the layout the kubelet keeps
    # (a subPath mount would pin the first version's file and see no update)
    _publish(tmp_path, "2026_12_06_01_00_00.1", {"sk-old": {"tenant": "a", "priority": 5}})
    ring = KeyRing(tmp_path / "keys.json", Caller(None, 5))
    assert ring.lookup("sk-old") == Caller("a", 5)
    _publish(tmp_path, "2026_12_06_01_01_00.2", {"sk-new": {"tenant": "b", "priority": 7}})
    ring.force_check()
    assert ring.lookup("sk-new") == Caller("b", 7)
    assert ring.lookup("sk-old") is None
    assert ring.reloads == 1


# -- checksums --------------------------------------------------------------------------------


def _checksums(values: dict[str, Any]) -> tuple[str, str]:
    rendered = render(values)
    worker = rendered.pod["metadata"]["annotations"]["checksum/config"]
    gateway = gateway_pod(rendered)["metadata"]["annotations"]["checksum/config"]
    return worker, gateway


def test_tuning_the_gateway_restarts_no_worker() -> None:
    worker, gateway = _checksums(ON)
    assert _checksums(ON) == (worker, gateway)
    tuned = _checksums(merge(ON, {"config": {"WORKER_GATEWAY_MAX_QUEUED": 500}}))
    assert tuned[0] == worker
    assert tuned[1] != gateway
    # a setting both read restarts both
    shared = _checksums(merge(ON, {"config": {"WORKER_QUEUE": "jobs-llama"}}))
    assert shared[0] != worker
    assert shared[1] != gateway
    # and switching the gateway on or off leaves the workers be
    assert render(CHART_SECRET).pod["metadata"]["annotations"]["checksum/config"] == worker


# -- selectors --------------------------------------------------------------------------------


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_no_selector_crosses_the_roles(all_on: Rendered) -> None:
    # pods for Deployments, Services, budgets and policies; Services for ServiceMonitors
    pods = {
        "worker": all_on.pod["metadata"]["labels"],
        "gateway": gateway_pod(all_on)["metadata"]["labels"],
    }
    services = {
        "worker": all_on.one("Service")["metadata"]["labels"],
        "gateway": all_on.one("Service", GATEWAY)["metadata"]["labels"],
    }
    checked = 0
    for manifest in all_on.manifests:
        kind, spec = manifest["kind"], manifest.get("spec", {})
        targets = pods
        if kind in {"Deployment", "PodDisruptionBudget"}:
            selector = spec["selector"]["matchLabels"]
        elif kind == "ServiceMonitor":
            selector, targets = spec["selector"]["matchLabels"], services
        elif kind == "NetworkPolicy":
            selector = spec["podSelector"]["matchLabels"]
        elif kind == "Service":
            selector = spec["selector"]
        else:
            continue
        checked += 1
        role = "gateway" if manifest["metadata"]["name"] == GATEWAY else "worker"
        other = "worker" if role == "gateway" else "gateway"
        assert _selects(selector, targets[role]), (kind, role)
        assert not _selects(selector, targets[other]), (kind, role)
    assert checked == 10


# -- Service, budget, Ingress, autoscaling ----------------------------------------------------


def test_service_values(all_on: Rendered) -> None:
    service = all_on.one("Service", GATEWAY)
    assert service["metadata"]["annotations"] == {"example.com/scrape": "true"}
    lb = render(merge(ON, {"gateway": {"service": {"type": "LoadBalancer", "port": 80}}}))
    spec = lb.one("Service", GATEWAY)["spec"]
    assert spec["type"] == "LoadBalancer"
    assert spec["ports"][0]["port"] == 80


def test_pdb(on: Rendered, all_on: Rendered) -> None:
    assert on.one("PodDisruptionBudget", GATEWAY)["spec"]["maxUnavailable"] == 1
    spec = all_on.one("PodDisruptionBudget", GATEWAY)["spec"]
    assert spec["minAvailable"] == 1
    assert "maxUnavailable" not in spec
    off = render(merge(ON, {"gateway": {"pdb": {"create": False}}}))
    assert [m["metadata"]["name"] for m in off.all("PodDisruptionBudget")] == [FULLNAME]
    both = merge(ON, {"gateway": {"pdb": {"minAvailable": 1, "maxUnavailable": "50%"}}})
    assert "gateway.pdb.minAvailable or gateway.pdb.maxUnavailable, not both" in render_error(both)


def test_ingress(all_on: Rendered) -> None:
    ingress = all_on.one("Ingress", GATEWAY)
    assert ingress["apiVersion"] == "networking.k8s.io/v1"
    assert ingress["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/proxy-buffering": "off",
        "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600",
    }
    spec = ingress["spec"]
    assert spec["ingressClassName"] == "nginx"
    assert spec["tls"] == [{"hosts": ["llm.example.com"], "secretName": "llm-example-tls"}]
    assert spec["rules"] == [
        {
            "host": "llm.example.com",
            "http": {
                "paths": [
                    {
                        "path": "/",
                        "pathType": "Prefix",
                        "backend": {"service": {"name": GATEWAY, "port": {"name": "http"}}},
                    }
                ]
            },
        }
    ]
    assert "https://llm.example.com/v1" in all_on.notes


def test_ingress_off_by_default_and_any_host() -> None:
    assert not render(ON).all("Ingress")
    hosts = [{"paths": [{"path": "/v1", "pathType": "Prefix"}]}]
    rendered = render(merge(ON, {"gateway": {"ingress": {"enabled": True, "hosts": hosts}}}))
    spec = rendered.one("Ingress", GATEWAY)["spec"]
    assert "ingressClassName" not in spec
    assert "tls" not in spec
    (rule,) = spec["rules"]
    assert "host" not in rule
    assert rule["http"]["paths"][0]["path"] == "/v1"


def test_autoscaling_on_cpu(all_on: Rendered) -> None:
    hpa = all_on.one("HorizontalPodAutoscaler", GATEWAY)
    assert hpa["apiVersion"] == "autoscaling/v2"
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": GATEWAY,
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 10)
    assert spec["metrics"] == [
        {
            "type": "Resource",
            "resource": {
                "name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": 70},
            },
        }
    ]
    assert spec["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 300}}
    # the HPA owns the replica count; the workers' is KEDA's
    assert "replicas" not in all_on.one("Deployment", GATEWAY)["spec"]
    assert not render(ON).all("HorizontalPodAutoscaler")


def test_autoscaling_is_checked() -> None:
    scaling = {"enabled": True, "minReplicas": 5, "maxReplicas": 3}
    values = merge(ON, {"gateway": {"autoscaling": scaling}})
    assert "gateway.autoscaling.minReplicas (5) exceeds" in render_error(values)
    no_request = merge(
        ON,
        {"gateway": {"autoscaling": {"enabled": True}, "resources": {"requests": {"cpu": None}}}},
    )
    assert "set gateway.resources.requests.cpu" in render_error(no_request)


# -- network policy ---------------------------------------------------------------------------


def test_network_policy_only_with_the_switch(on: Rendered) -> None:
    assert not on.all("NetworkPolicy")


def test_network_policy(all_on: Rendered) -> None:
    policy = all_on.one("NetworkPolicy", GATEWAY)["spec"]
    assert (
        policy["podSelector"]["matchLabels"]
        == (all_on.one("Deployment", GATEWAY)["spec"]["selector"]["matchLabels"])
    )
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    monitoring, clients = policy["ingress"]
    assert monitoring["ports"] == clients["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert monitoring["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {},
        }
    ]
    assert clients["from"] == ALL_ON["gateway"]["networkPolicy"]["from"]
    # the workers' egress, but the OTLP collector's (the gateway exports no traces)
    worker_egress = all_on.one("NetworkPolicy")["spec"]["egress"]
    assert [p["port"] for p in worker_egress[3]["ports"]] == [4317, 4318]
    assert policy["egress"] == worker_egress[:3]


def test_network_policy_clients_default_to_anyone() -> None:
    values = merge(
        ON,
        {
            "networkPolicy": {"enabled": True, "extraEgress": [{"ports": [{"port": 443}]}]},
            "gateway": {
                "networkPolicy": {
                    "extraIngress": [{"ports": [{"port": 9999, "protocol": "TCP"}]}],
                    "extraEgress": [{"ports": [{"port": 8443, "protocol": "TCP"}]}],
                }
            },
        },
    )
    policy = render(values).one("NetworkPolicy", GATEWAY)["spec"]
    _, clients, extra = policy["ingress"]
    assert clients == {"ports": [{"port": "http", "protocol": "TCP"}]}  # no `from`: anyone
    assert extra == {"ports": [{"port": 9999, "protocol": "TCP"}]}
    _dns, broker, redis, own = policy["egress"]  # the workers' extraEgress is theirs
    assert own == {"ports": [{"port": 8443, "protocol": "TCP"}]}
    assert [p["port"] for p in broker["ports"]] == [5672, 5671]
    assert [p["port"] for p in redis["ports"]] == [6379, 26379]


# -- metrics ----------------------------------------------------------------------------------


def test_service_monitor_follows_the_workers(all_on: Rendered) -> None:
    monitor = all_on.one("ServiceMonitor", GATEWAY)
    worker = all_on.one("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http"
    assert endpoint["path"] == "/metrics"
    assert endpoint == worker["spec"]["endpoints"][0]  # interval, relabelings: the same
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["llm"]}
    service = all_on.one("Service", GATEWAY)["metadata"]["labels"]
    assert _selects(monitor["spec"]["selector"]["matchLabels"], service)
    assert not render(ON).all("ServiceMonitor")


# -- the model volume -------------------------------------------------------------------------


def test_model_volume_only_when_asked(all_on: Rendered) -> None:
    on = render(merge(ON, {"model": {"existingClaim": "llm-models"}}))
    assert "model" not in {v["name"] for v in gateway_pod(on)["spec"]["volumes"]}
    volumes = {v["name"]: v for v in gateway_pod(all_on)["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {
        "claimName": "llm-models",
        "readOnly": True,
    }
    mounts = {m["name"]: m for m in gateway_container(all_on)["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}


def test_model_volume_needs_a_model() -> None:
    message = render_error(merge(ON, {"gateway": {"mountModel": True}}))
    assert "gateway.mountModel needs the model volume" in message


# -- the schema -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"gateway": {"enabled": "yes"}}, "/gateway/enabled': got string, want boolean"),
        ({"gateway": {"replicas": 2}}, "additional properties 'replicas' not allowed"),
        ({"gateway": {"replicaCount": -1}}, "/gateway/replicaCount"),
        ({"config": {"WORKER_GATEWAY_PORT": 0}}, "/config/WORKER_GATEWAY_PORT"),
        ({"config": {"WORKER_GATEWAY_PORT": "8000"}}, "/config/WORKER_GATEWAY_PORT"),
        ({"config": {"WORKER_GATEWAY_MAX_QUEUED": -1}}, "/config/WORKER_GATEWAY_MAX_QUEUED"),
        ({"config": {"WORKER_GATEWAY_KEYS_FILE": "keys.json"}}, "/config/WORKER_GATEWAY_KEYS_FILE"),
        ({"config": {"WORKER_GATEWAY_KEY_FILE": "/k"}}, "'WORKER_GATEWAY_KEY_FILE' not allowed"),
        ({"gateway": {"apiKeys": {"mountPath": "keys"}}}, "/gateway/apiKeys/mountPath"),
        ({"gateway": {"apiKeys": {"key": "a/b.json"}}}, "/gateway/apiKeys/key"),
        ({"gateway": {"apiKeys": {"secret": "k"}}}, "additional properties 'secret' not allowed"),
        ({"gateway": {"image": {"digest": "latest"}}}, "/gateway/image/digest"),
        ({"gateway": {"service": {"port": 70000}}}, "/gateway/service/port"),
        ({"gateway": {"service": {"type": "ExternalName"}}}, "/gateway/service/type"),
        ({"gateway": {"livenessProbe": {"successThreshold": 2}}}, "successThreshold"),
        ({"gateway": {"pdb": {"maxUnavailable": "half"}}}, "/gateway/pdb/maxUnavailable"),
        (
            {"gateway": {"autoscaling": {"targetCPUUtilizationPercentage": 0}}},
            "/gateway/autoscaling/targetCPUUtilizationPercentage",
        ),
        ({"gateway": {"autoscaling": {"minReplicas": 0}}}, "/gateway/autoscaling/minReplicas"),
        (
            {"gateway": {"ingress": {"hosts": [{"paths": [{"path": "/", "pathType": "All"}]}]}}},
            "/gateway/ingress/hosts/0/paths/0/pathType",
        ),
        (
            {
                "gateway": {
                    "ingress": {"hosts": [{"paths": [{"path": "v1", "pathType": "Prefix"}]}]}
                }
            },
            "/gateway/ingress/hosts/0/paths/0/path",
        ),
        ({"gateway": {"ingress": {"hosts": []}}}, "/gateway/ingress/hosts"),
        ({"gateway": {"ingress": {"annotations": {"a": 1}}}}, "/gateway/ingress/annotations/a"),
        ({"gateway": {"networkPolicy": {"from": {}}}}, "/gateway/networkPolicy/from"),
        ({"gateway": {"tmp": {"sizeLimit": "lots"}}}, "/gateway/tmp/sizeLimit"),
        ({"gateway": {"resources": {"limits": {"cpu": "fast"}}}}, "/gateway/resources/limits/cpu"),
    ],
)
def test_schema_rejects(values: dict[str, Any], expected: str) -> None:
    assert expected in schema_error(merge(CHART_SECRET, values))


def test_schema_accepts_the_documented_examples() -> None:
    chart().validate_schema(chart().merge_values(ALL_ON))
    chart().validate_schema(chart().merge_values(KEYS))


def test_the_gateway_may_have_its_own_service_users() -> None:
    """Its own Secret's URLs (its own RabbitMQ and Redis users, with trtllm-gateway's
    grants), under the same keys; the workers keep theirs."""
    rendered = render(merge(ON, {"gateway": {"existingSecret": "gateway-urls"}}))
    env = gateway_env(rendered)
    for name in ("WORKER_AMQP_URL", "WORKER_REDIS_URL", "WORKER_REDIS_SENTINEL_PASSWORD"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "gateway-urls", name
        assert (
            env[name]["valueFrom"]["secretKeyRef"]["key"]
            == (rendered.env()[name]["valueFrom"]["secretKeyRef"]["key"])
        )
        assert rendered.env()[name]["valueFrom"]["secretKeyRef"]["name"] == FULLNAME, name
    annotations = gateway_pod(rendered)["metadata"]["annotations"]
    assert "checksum/secret" not in annotations  # the chart's Secret is not its
    assert "checksum/secret" in gateway_pod(render(ON))["metadata"]["annotations"]
