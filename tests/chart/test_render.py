"""The chart rendered with default values (plus the URLs it requires) and with every
optional part switched on: assertions on the objects, as helm-unittest would make them."""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import pytest

from tests.chart.support import (
    ALL_ON,
    AMQP_URL,
    CHART_SECRET,
    DASHBOARD,
    EXISTING_SECRET,
    FULLNAME,
    MANAGEMENT_URL,
    PASSWORDS,
    REDIS_URL,
    Rendered,
    chart,
    chart_settings,
    merge,
    render,
    render_error,
)


@pytest.fixture(scope="module")
def default() -> Rendered:
    return render(CHART_SECRET)


@pytest.fixture(scope="module")
def all_on() -> Rendered:
    return render(ALL_ON)


def test_default_release_objects(default: Rendered) -> None:
    assert default.kinds() == [
        "ConfigMap",
        "Deployment",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "ServiceAccount",
    ]
    assert {m["metadata"]["namespace"] for m in default.manifests} == {"llm"}


def test_every_optional_object(all_on: Rendered) -> None:
    assert all_on.kinds() == [
        "ConfigMap",
        "ConfigMap",
        "Deployment",
        "Deployment",  # the gateway's, as the rest of the doubles (tests/chart/test_gateway.py)
        "HorizontalPodAutoscaler",
        "Ingress",
        "NetworkPolicy",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "PodDisruptionBudget",
        "ScaledObject",
        "Secret",
        "Service",
        "Service",
        "ServiceAccount",
        "ServiceMonitor",
        "ServiceMonitor",
        "TriggerAuthentication",
    ]


# -- probes and port ---------------------------------------------------------------------


@pytest.mark.parametrize("values", [CHART_SECRET, ALL_ON], ids=["default", "all-on"])
def test_probes_on_the_http_port(values: dict[str, Any]) -> None:
    rendered = render(values)
    container = rendered.container
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert rendered.config["WORKER_HTTP_PORT"] == "8080"
    for probe, path in [
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ]:
        assert container[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    assert container["livenessProbe"]["successThreshold"] == 1
    service = rendered.one("Service")
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}
    ]


def test_the_port_follows_the_setting() -> None:
    rendered = render(merge(CHART_SECRET, {"config": {"WORKER_HTTP_PORT": 9090}}))
    assert rendered.container["ports"][0]["containerPort"] == 9090
    assert rendered.config["WORKER_HTTP_PORT"] == "9090"
    assert rendered.container["readinessProbe"]["httpGet"]["port"] == "http"


def test_probes_can_be_switched_off() -> None:
    off = {"enabled": False}
    rendered = render(
        merge(CHART_SECRET, {"startupProbe": off, "livenessProbe": off, "readinessProbe": off})
    )
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & set(rendered.container)


def _startup_budget(rendered: Rendered) -> int:
    probe = rendered.container["startupProbe"]
    return int(probe["initialDelaySeconds"] + probe["failureThreshold"] * probe["periodSeconds"])


def test_the_startup_probe_waits_for_the_engine(default: Rendered) -> None:
    # the worker opens its port only once the engine is loaded, which it may take
    # WORKER_ENGINE_START_TIMEOUT_S to do (then it exits 69 by itself)
    assert _startup_budget(default) >= 1800
    assert default.container["startupProbe"]["failureThreshold"] == 186
    slower = render(merge(CHART_SECRET, {"config": {"WORKER_ENGINE_START_TIMEOUT_S": 3600}}))
    assert _startup_budget(slower) >= 3600
    given = render(merge(CHART_SECRET, {"startupProbe": {"failureThreshold": 30}}))
    assert given.container["startupProbe"]["failureThreshold"] == 30


# -- grace period --------------------------------------------------------------------------


def test_grace_period_above_the_drain_timeout(default: Rendered) -> None:
    assert default.config["WORKER_DRAIN_TIMEOUT_S"] == "30"
    assert default.pod_spec["terminationGracePeriodSeconds"] == 60


@pytest.mark.parametrize("drain", [0, 5, 30, 45.5, 600, 3600])
def test_grace_period_follows_the_drain_timeout(drain: float) -> None:
    rendered = render(merge(CHART_SECRET, {"config": {"WORKER_DRAIN_TIMEOUT_S": drain}}))
    grace = rendered.pod_spec["terminationGracePeriodSeconds"]
    assert isinstance(grace, int)
    assert grace == math.ceil(drain) + 30
    assert float(rendered.config["WORKER_DRAIN_TIMEOUT_S"]) == drain


def test_grace_period_extra_time_is_configurable() -> None:
    values = merge(
        CHART_SECRET,
        {"config": {"WORKER_DRAIN_TIMEOUT_S": 120}, "terminationGraceExtraSeconds": 15},
    )
    assert render(values).pod_spec["terminationGracePeriodSeconds"] == 135


# -- GPU placement -------------------------------------------------------------------------


def test_one_gpu_by_default_and_gpu_taint_tolerated(default: Rendered) -> None:
    assert default.container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
        default.pod_spec["tolerations"]
    )
    assert default.config["WORKER_ENGINE"] == "trtllm"


def test_gpu_placement_values(all_on: Rendered) -> None:
    spec = all_on.pod_spec
    assert all_on.container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["affinity"] == ALL_ON["affinity"]
    assert spec["priorityClassName"] == "gpu-inference"
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["topologySpreadConstraints"] == ALL_ON["topologySpreadConstraints"]


def test_tensor_parallelism_needs_as_many_gpus() -> None:
    message = render_error(merge(CHART_SECRET, {"config": {"WORKER_TENSOR_PARALLEL_SIZE": 4}}))
    assert "WORKER_TENSOR_PARALLEL_SIZE" in message
    assert "nvidia.com/gpu" in message
    values = merge(
        CHART_SECRET,
        {
            "config": {"WORKER_TENSOR_PARALLEL_SIZE": 4},
            "resources": {"limits": {"nvidia.com/gpu": 4}},
        },
    )
    assert render(values).container["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_echo_engine_without_a_gpu() -> None:
    values = merge(
        CHART_SECRET,
        {"config": {"WORKER_ENGINE": "echo"}, "resources": {"limits": {"nvidia.com/gpu": None}}},
    )
    rendered = render(values)
    assert "nvidia.com/gpu" not in rendered.container["resources"].get("limits", {})
    assert rendered.config["WORKER_ENGINE"] == "echo"
    assert "WARNING" not in rendered.notes


def test_the_engine_needs_its_model() -> None:
    message = render_error(merge(CHART_SECRET, {"config": {"WORKER_MODEL": ""}}))
    assert "config.WORKER_MODEL is required with WORKER_ENGINE=trtllm" in message
    executor = merge(CHART_SECRET, {"config": {"WORKER_ENGINE": "trtllm-executor"}})
    assert "config.WORKER_ENGINE_DIR is required" in render_error(executor)
    executor["config"]["WORKER_ENGINE_DIR"] = "/models/engine"
    assert "config.WORKER_TOKENIZER is required" in render_error(executor)
    executor["config"]["WORKER_TOKENIZER"] = "/models/tokenizer"
    assert render(executor).config["WORKER_ENGINE_DIR"] == "/models/engine"


# -- settings and secrets ------------------------------------------------------------------


@pytest.mark.parametrize("values", [CHART_SECRET, EXISTING_SECRET, ALL_ON])
def test_configmap_holds_every_setting_but_the_urls(values: dict[str, Any]) -> None:
    rendered = render(values)
    assert set(rendered.config) == chart_settings()
    assert rendered.container["envFrom"] == [{"configMapRef": {"name": FULLNAME}}]
    for key, value in rendered.config.items():
        assert isinstance(value, str), key
        assert "://" not in value, key
        assert not any(password in value for password in PASSWORDS), key


def test_configmap_values_are_the_chart_defaults(default: Rendered) -> None:
    defaults = chart().values["config"]
    for key, value in defaults.items():
        expected = str(value).lower() if isinstance(value, bool) else str(value)
        if isinstance(value, float) and value.is_integer():
            expected = str(int(value))
        assert default.config[key] == expected, key


def test_large_numbers_are_not_printed_as_floats() -> None:
    values = merge(
        CHART_SECRET,
        {"config": {"WORKER_STREAM_TTL_S": 10_000_000, "WORKER_MAX_NUM_TOKENS": 1_048_576}},
    )
    config = render(values).config
    assert config["WORKER_STREAM_TTL_S"] == "10000000"
    assert config["WORKER_MAX_NUM_TOKENS"] == "1048576"


def _url_refs(rendered: Rendered) -> dict[str, dict[str, str]]:
    env = rendered.env()
    return {
        name: env[name]["valueFrom"]["secretKeyRef"]
        for name in ("WORKER_AMQP_URL", "WORKER_REDIS_URL")
    }


def test_chart_made_secret_holds_the_urls(default: Rendered) -> None:
    secret = default.one("Secret")
    assert secret["type"] == "Opaque"
    decoded = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert decoded == {"amqp-url": AMQP_URL, "redis-url": REDIS_URL}
    assert _url_refs(default) == {
        "WORKER_AMQP_URL": {"name": FULLNAME, "key": "amqp-url"},
        "WORKER_REDIS_URL": {"name": FULLNAME, "key": "redis-url"},
    }
    # a new password restarts the pods
    assert "checksum/secret" in default.pod["metadata"]["annotations"]


def test_existing_secret_is_referenced_and_none_is_made() -> None:
    rendered = render(EXISTING_SECRET)
    assert "Secret" not in rendered.kinds()
    assert _url_refs(rendered) == {
        "WORKER_AMQP_URL": {"name": "worker-urls", "key": "amqp"},
        "WORKER_REDIS_URL": {"name": "worker-urls", "key": "redis"},
    }
    assert "checksum/secret" not in rendered.pod["metadata"]["annotations"]


@pytest.mark.parametrize("values", [CHART_SECRET, ALL_ON], ids=["default", "all-on"])
def test_passwords_only_in_the_secret(values: dict[str, Any]) -> None:
    rendered = render(values)
    for manifest in rendered.manifests:
        text = json.dumps(manifest)
        for password in PASSWORDS:
            assert password not in text, manifest["kind"]  # Secret data is base64
    assert not any(p in rendered.notes for p in PASSWORDS)


@pytest.mark.parametrize(
    "secrets",
    [{}, {"amqpUrl": AMQP_URL}, {"redisUrl": REDIS_URL}],
    ids=["nothing", "amqp-only", "redis-only"],
)
def test_no_credentials_no_release(secrets: dict[str, str]) -> None:
    message = render_error({"secrets": secrets})
    assert "secrets.existingSecret" in message
    assert "the chart ships no credentials" in message


def test_settings_change_restarts_the_pods(default: Rendered) -> None:
    changed = render(merge(CHART_SECRET, {"config": {"WORKER_MAX_BATCH": 32}}))
    again = render(CHART_SECRET)
    checksum = default.pod["metadata"]["annotations"]["checksum/config"]
    assert again.pod["metadata"]["annotations"]["checksum/config"] == checksum
    assert changed.pod["metadata"]["annotations"]["checksum/config"] != checksum


# -- security ------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [CHART_SECRET, ALL_ON], ids=["default", "all-on"])
def test_security_context(values: dict[str, Any]) -> None:
    rendered = render(values)
    pod = rendered.pod_spec["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert (pod["runAsUser"], pod["runAsGroup"], pod["fsGroup"]) == (1000, 1000, 1000)
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    container = rendered.container["securityContext"]
    assert container["runAsNonRoot"] is True
    assert container["allowPrivilegeEscalation"] is False
    assert container["readOnlyRootFilesystem"] is True
    assert container["capabilities"] == {"drop": ["ALL"]}
    assert container["seccompProfile"] == {"type": "RuntimeDefault"}
    assert rendered.pod_spec["automountServiceAccountToken"] is False


RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


@pytest.mark.parametrize("values", [CHART_SECRET, ALL_ON], ids=["default", "all-on"])
def test_restricted_pod_security_standard(values: dict[str, Any]) -> None:
    # what a namespace enforcing the "restricted" Pod Security Standard admits (for the
    # chart's own container; init containers come from the operator)
    rendered = render(values)
    spec = rendered.pod_spec
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(spec)
    for volume in spec["volumes"]:
        assert set(volume) - {"name"} <= RESTRICTED_VOLUME_TYPES, volume["name"]
    container = rendered.container
    context = container["securityContext"]
    assert context.get("privileged", False) is False
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert not context["capabilities"].get("add")
    assert context.get("runAsNonRoot", spec["securityContext"].get("runAsNonRoot")) is True
    assert context.get("runAsUser", spec["securityContext"].get("runAsUser")) != 0
    assert all("hostPort" not in port for port in container["ports"])


def test_writable_places_of_a_read_only_root(default: Rendered) -> None:
    volumes, mounts = default.volumes(), default.mounts()
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory"}
    assert mounts["/dev/shm"]["name"] == "shm"
    assert volumes["tmp"]["emptyDir"] == {}
    assert mounts["/tmp"]["name"] == "tmp"
    assert volumes["cache"]["emptyDir"] == {}
    assert mounts["/home/worker"]["name"] == "cache"
    env = default.env()
    assert env["HOME"]["value"] == "/home/worker"
    assert env["XDG_CACHE_HOME"]["value"] == "/home/worker/.cache"
    assert env["HF_HOME"]["value"] == "/home/worker/.cache/huggingface"


def test_volume_size_limits(all_on: Rendered) -> None:
    volumes = all_on.volumes()
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes["tmp"]["emptyDir"] == {"sizeLimit": "2Gi"}
    assert volumes["cache"]["emptyDir"] == {"sizeLimit": "20Gi"}


# -- model volume ----------------------------------------------------------------------------


def test_model_from_an_existing_claim(all_on: Rendered) -> None:
    assert all_on.volumes()["model"]["persistentVolumeClaim"] == {
        "claimName": "llm-models",
        "readOnly": True,
    }
    assert all_on.mounts()["/models"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert "WARNING: no model volume" not in all_on.notes


def test_model_from_a_host_path() -> None:
    values = merge(
        CHART_SECRET, {"model": {"hostPath": "/data/models", "mountPath": "/m", "subPath": "x"}}
    )
    rendered = render(values)
    assert rendered.volumes()["model"]["hostPath"] == {"path": "/data/models", "type": "Directory"}
    assert rendered.mounts()["/m"] == {
        "name": "model",
        "mountPath": "/m",
        "readOnly": True,
        "subPath": "x",
    }


def test_no_model_volume_is_warned_about(default: Rendered) -> None:
    assert "model" not in default.volumes()
    assert "WARNING: no model volume" in default.notes


def test_one_model_source_only() -> None:
    values = merge(CHART_SECRET, {"model": {"existingClaim": "a", "hostPath": "/b"}})
    assert "model.existingClaim or model.hostPath, not both" in render_error(values)


# -- the rest of the pod ---------------------------------------------------------------------


def test_image_reference() -> None:
    assert render(CHART_SECRET).container["image"] == "trtllm-worker:0.1.0"
    tagged = merge(CHART_SECRET, {"image": {"registry": "r.example.com", "tag": "1.0.0"}})
    assert render(tagged).container["image"] == "r.example.com/trtllm-worker:1.0.0"
    digest = "sha256:" + "ab" * 32
    assert render(ALL_ON).container["image"] == f"registry.example.com/ml/trtllm-worker@{digest}"


def test_extras_reach_the_pod(all_on: Rendered) -> None:
    pod, spec, container = all_on.pod, all_on.pod_spec, all_on.container
    assert pod["metadata"]["annotations"]["example.com/owner"] == "ml-platform"
    assert pod["metadata"]["labels"]["cost-center"] == "llm"
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert spec["imagePullSecrets"] == [{"name": "registry-pull"}]
    assert spec["initContainers"] == ALL_ON["initContainers"]
    assert all_on.env()["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "WARN"}
    assert all_on.volumes()["tls"] == {"name": "tls", "secret": {"secretName": "worker-tls"}}
    assert all_on.mounts()["/etc/worker/tls"]["readOnly"] is True
    assert all_on.config["WORKER_AMQP_CA_FILE"] == "/etc/worker/tls/ca.crt"
    assert container["args"] == ["serve"]
    account = all_on.one("ServiceAccount")
    assert spec["serviceAccountName"] == account["metadata"]["name"] == FULLNAME
    assert account["metadata"]["annotations"] == {"example.com/role": "llm-worker"}


def test_rollout_needs_no_spare_gpu(default: Rendered) -> None:
    spec = default.deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }


def test_selectors_match_the_pods(all_on: Rendered) -> None:
    labels = all_on.pod["metadata"]["labels"]
    selectors = [
        all_on.deployment["spec"]["selector"]["matchLabels"],
        all_on.one("Service")["spec"]["selector"],
        all_on.one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
    ]
    for selector in selectors:
        assert selector.items() <= labels.items()


# -- disruption budget -----------------------------------------------------------------------


def test_pdb(default: Rendered, all_on: Rendered) -> None:
    assert default.one("PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    spec = all_on.one("PodDisruptionBudget")["spec"]
    assert spec["minAvailable"] == 1
    assert "maxUnavailable" not in spec
    percent = render(merge(CHART_SECRET, {"pdb": {"maxUnavailable": "50%"}}))
    assert percent.one("PodDisruptionBudget")["spec"]["maxUnavailable"] == "50%"
    off = render(merge(CHART_SECRET, {"pdb": {"create": False}}))
    assert "PodDisruptionBudget" not in off.kinds()
    both = merge(CHART_SECRET, {"pdb": {"minAvailable": 1, "maxUnavailable": 1}})
    assert "not both" in render_error(both)


# -- metrics -----------------------------------------------------------------------------------


def test_service_monitor(all_on: Rendered) -> None:
    monitor = all_on.one("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = monitor["spec"]
    assert spec["endpoints"][0]["port"] == "http"
    assert spec["endpoints"][0]["path"] == "/metrics"
    assert spec["endpoints"][0]["interval"] == "15s"
    assert spec["endpoints"][0]["relabelings"] == ALL_ON["metrics"]["serviceMonitor"]["relabelings"]
    assert spec["namespaceSelector"] == {"matchNames": ["llm"]}
    service_labels = all_on.one("Service")["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= service_labels.items()


def test_dashboard_configmap(all_on: Rendered) -> None:
    configmap = all_on.one("ConfigMap", f"{FULLNAME}-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    shipped = json.loads(configmap["data"]["trtllm-worker.json"])
    assert shipped == json.loads(DASHBOARD.read_text(encoding="utf-8"))


# -- KEDA ----------------------------------------------------------------------------------------


def test_keda_scales_on_the_job_queue(all_on: Rendered) -> None:
    scaled = all_on.one("ScaledObject")["spec"]
    assert scaled["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": FULLNAME,
    }
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (1, 8)
    [trigger] = scaled["triggers"]
    assert trigger["type"] == "rabbitmq"
    metadata = trigger["metadata"]
    assert metadata["queueName"] == "jobs-llama" == all_on.config["WORKER_QUEUE"]
    # the management API counts unacknowledged jobs too; AMQP would scale busy pods in
    assert metadata["protocol"] == "http"
    assert metadata["mode"] == "QueueLength"
    assert metadata["excludeUnacknowledged"] == "false"
    assert metadata["value"] == "64" == all_on.config["WORKER_MAX_BATCH"]
    assert metadata["vhostName"] == "/"
    # KEDA reads trigger metadata as strings only
    assert all(isinstance(v, str) for v in metadata.values())
    assert scaled["fallback"] == {"failureThreshold": 3, "replicas": 2}
    behavior = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 600
    # KEDA owns the replica count
    assert "replicas" not in all_on.deployment["spec"]


def test_keda_reads_the_management_url_from_the_secret(all_on: Rendered) -> None:
    [trigger] = all_on.one("ScaledObject")["spec"]["triggers"]
    auth = all_on.one("TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": "host", "name": FULLNAME, "key": "rabbitmq-management-url"}
    ]
    data = all_on.one("Secret")["data"]
    assert base64.b64decode(data["rabbitmq-management-url"]).decode() == MANAGEMENT_URL
    assert "host" not in trigger["metadata"]


def test_keda_with_an_existing_secret() -> None:
    rendered = render(merge(EXISTING_SECRET, {"keda": {"enabled": True}}))
    assert rendered.one("TriggerAuthentication")["spec"]["secretTargetRef"] == [
        {"parameter": "host", "name": "worker-urls", "key": "management"}
    ]


def test_keda_target_follows_the_batch_or_its_own_value() -> None:
    smaller = render(merge(ALL_ON, {"config": {"WORKER_MAX_BATCH": 16}}))
    assert smaller.one("ScaledObject")["spec"]["triggers"][0]["metadata"]["value"] == "16"
    own = render(merge(ALL_ON, {"keda": {"queueLength": 100, "activationQueueLength": 5}}))
    metadata = own.one("ScaledObject")["spec"]["triggers"][0]["metadata"]
    assert (metadata["value"], metadata["activationValue"]) == ("100", "5")


def test_keda_without_a_management_url_fails() -> None:
    message = render_error(merge(CHART_SECRET, {"keda": {"enabled": True}}))
    assert "secrets.rabbitmqManagementUrl" in message


def test_keda_replica_bounds_are_checked() -> None:
    values = merge(ALL_ON, {"keda": {"minReplicaCount": 5, "maxReplicaCount": 2}})
    assert "keda.minReplicaCount (5) exceeds keda.maxReplicaCount (2)" in render_error(values)


def test_no_tracing_variables_by_default(default: Rendered) -> None:
    assert not [name for name in default.env() if name.startswith("OTEL_")]


def test_tracing_passes_the_otel_variables() -> None:
    rendered = render(
        merge(
            CHART_SECRET,
            {
                "tracing": {
                    "endpoint": "http://otel-collector.observability:4317",
                    "protocol": "grpc",
                    "serviceName": "gen-workers",
                    "sampler": "parentbased_traceidratio",
                    "samplerArg": "0.1",
                    "resourceAttributes": "deployment.environment.name=prod",
                    "headersSecret": {"name": "otlp-auth", "key": "headers"},
                    "env": {"OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"},
                }
            },
        )
    )
    env = rendered.env()
    values = {name: item.get("value") for name, item in env.items()}
    assert values["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    assert values["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert values["OTEL_SERVICE_NAME"] == "gen-workers"
    assert values["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert values["OTEL_TRACES_SAMPLER_ARG"] == "0.1"
    assert values["OTEL_EXPORTER_OTLP_COMPRESSION"] == "gzip"
    assert values["OTEL_RESOURCE_ATTRIBUTES"] == (
        "k8s.pod.name=$(OTEL_K8S_POD_NAME),k8s.namespace.name=$(OTEL_K8S_NAMESPACE_NAME),"
        "k8s.node.name=$(OTEL_K8S_NODE_NAME),deployment.environment.name=prod"
    )
    assert env["OTEL_K8S_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["OTEL_EXPORTER_OTLP_HEADERS"]["valueFrom"] == {
        "secretKeyRef": {"name": "otlp-auth", "key": "headers"}
    }
    # Kubernetes expands $(VAR) only from variables defined before it
    names = list(env)
    assert names.index("OTEL_K8S_NODE_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")


def test_no_network_policy_by_default(default: Rendered) -> None:
    assert "NetworkPolicy" not in default.kinds()


def test_network_policy_allows_only_dns_broker_redis_and_monitoring() -> None:
    rendered = render(merge(CHART_SECRET, {"networkPolicy": {"enabled": True}}))
    policy = rendered.one("NetworkPolicy")["spec"]
    assert (
        policy["podSelector"]["matchLabels"]
        == rendered.deployment["spec"]["selector"]["matchLabels"]
    )
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    (ingress,) = policy["ingress"]
    assert ingress["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert ingress["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {},
        }
    ]
    dns, broker, redis = policy["egress"]  # no OTLP rule without tracing.endpoint
    assert dns["ports"] == [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
    assert dns["to"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
    ]
    assert broker == {
        "ports": [{"port": 5672, "protocol": "TCP"}, {"port": 5671, "protocol": "TCP"}]
    }
    assert [p["port"] for p in redis["ports"]] == [6379, 26379]


def test_network_policy_adds_the_otlp_collector_and_given_peers() -> None:
    broker_peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mq"}}}
    rendered = render(
        merge(
            CHART_SECRET,
            {
                "tracing": {"endpoint": "http://otel-collector.observability:4318"},
                "networkPolicy": {
                    "enabled": True,
                    "broker": {"ports": [5671], "to": [broker_peer]},
                    "otlp": {"ports": [4318], "to": []},
                    "extraEgress": [{"ports": [{"port": 443, "protocol": "TCP"}]}],
                },
            },
        )
    )
    egress = rendered.one("NetworkPolicy")["spec"]["egress"]
    assert egress[1] == {"ports": [{"port": 5671, "protocol": "TCP"}], "to": [broker_peer]}
    assert egress[3] == {"ports": [{"port": 4318, "protocol": "TCP"}]}
    assert egress[4] == {"ports": [{"port": 443, "protocol": "TCP"}]}
