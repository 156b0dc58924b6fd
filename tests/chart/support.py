"""The deployment artefacts under test, and the chart rendered offline by Helm's own code
(helm-python-sdk embeds the Helm SDK: no helm binary, no cluster, no network)."""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import helm_python
import yaml

from trtllm_worker.config import Settings

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "helm" / "trtllm-worker"
DASHBOARD = CHART_DIR / "dashboards" / "trtllm-worker.json"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"

RELEASE = "demo"
NAMESPACE = "llm"
FULLNAME = f"{RELEASE}-trtllm-worker"
URL_SETTINGS = frozenset({"WORKER_AMQP_URL", "WORKER_REDIS_URL", "WORKER_REDIS_SENTINEL_PASSWORD"})
"""Credentials: they come from the Secret, not the ConfigMap."""

Manifest = dict[str, Any]

AMQP_URL = "amqp://worker:amqp-pass-1f3e@rabbitmq:5672/"
REDIS_URL = "redis://:redis-pass-9c2d@redis:6379/0"
MANAGEMENT_URL = "http://worker:mgmt-pass-77aa@rabbitmq:15672/"
PASSWORDS = ("amqp-pass-1f3e", "redis-pass-9c2d", "mgmt-pass-77aa")

# the least a release needs: the URLs, in a Secret the chart makes
CHART_SECRET: dict[str, Any] = {"secrets": {"amqpUrl": AMQP_URL, "redisUrl": REDIS_URL}}
# the recommended way: a Secret the operator made, with key names of their own
EXISTING_SECRET: dict[str, Any] = {
    "secrets": {
        "existingSecret": "worker-urls",
        "amqpUrlKey": "amqp",
        "redisUrlKey": "redis",
        "rabbitmqManagementUrlKey": "management",
    }
}


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` deep-merged over `base` (as Helm merges values files)."""
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


# every optional part switched on
ALL_ON: dict[str, Any] = merge(
    CHART_SECRET,
    {
        "secrets": {"rabbitmqManagementUrl": MANAGEMENT_URL},
        "commonLabels": {"team": "ml"},
        "image": {
            "registry": "registry.example.com",
            "repository": "ml/trtllm-worker",
            "digest": "sha256:" + "ab" * 32,
        },
        "imagePullSecrets": [{"name": "registry-pull"}],
        "config": {
            "WORKER_QUEUE": "jobs-llama",
            "WORKER_TENSOR_PARALLEL_SIZE": 2,
            "WORKER_MODEL": "/models/Llama-3.1-8B-Instruct",
            "WORKER_AMQP_CA_FILE": "/etc/worker/tls/ca.crt",
        },
        "model": {"existingClaim": "llm-models"},
        "resources": {
            "limits": {"nvidia.com/gpu": 2, "memory": "64Gi"},
            "requests": {"cpu": "8", "memory": "48Gi"},
        },
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": "nvidia.com/gpu.product",
                                    "operator": "In",
                                    "values": ["NVIDIA-H100-80GB-HBM3"],
                                }
                            ]
                        }
                    ]
                }
            }
        },
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "trtllm-worker"}},
            }
        ],
        "priorityClassName": "gpu-inference",
        "runtimeClassName": "nvidia",
        "podAnnotations": {"example.com/owner": "ml-platform"},
        "podLabels": {"cost-center": "llm"},
        "shm": {"sizeLimit": "16Gi"},
        "tmp": {"sizeLimit": "2Gi"},
        "cache": {"sizeLimit": "20Gi"},
        "extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"}],
        "networkPolicy": {"enabled": True},
        "tracing": {
            "endpoint": "http://otel-collector.observability:4318",
            "headersSecret": {"name": "otlp-auth"},
        },
        "extraVolumes": [{"name": "tls", "secret": {"secretName": "worker-tls"}}],
        "extraVolumeMounts": [{"name": "tls", "mountPath": "/etc/worker/tls", "readOnly": True}],
        "initContainers": [
            {"name": "wait-for-model", "image": "busybox:1.37", "command": ["true"]}
        ],
        "service": {"annotations": {"example.com/scrape": "true"}},
        "metrics": {
            "serviceMonitor": {
                "enabled": True,
                "additionalLabels": {"release": "kube-prometheus-stack"},
                "interval": "15s",
                "relabelings": [
                    {"action": "replace", "targetLabel": "cluster", "replacement": "a"}
                ],
            }
        },
        "dashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}},
        "pdb": {"minAvailable": 1},
        "keda": {
            "enabled": True,
            "minReplicaCount": 1,
            "maxReplicaCount": 8,
            "vhostName": "/",
            "fallback": {"failureThreshold": 3, "replicas": 2},
        },
        "serviceAccount": {"annotations": {"example.com/role": "llm-worker"}},
        "gateway": {
            "enabled": True,
            "image": {"tag": "0.1.0-cpu"},
            "apiKeys": {"existingSecret": "gateway-keys"},
            "mountModel": True,
            "nodeSelector": {"node-role.example.com/cpu": "true"},
            "podAnnotations": {"example.com/owner": "ml-platform"},
            "podLabels": {"cost-center": "llm"},
            "extraEnv": [{"name": "WEB_CONCURRENCY", "value": "1"}],
            "tmp": {"sizeLimit": "2Gi"},
            "service": {"annotations": {"example.com/scrape": "true"}},
            "ingress": {
                "enabled": True,
                "className": "nginx",
                "annotations": {
                    "nginx.ingress.kubernetes.io/proxy-buffering": "off",
                    "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600",
                },
                "tls": [{"hosts": ["llm.example.com"], "secretName": "llm-example-tls"}],
            },
            "autoscaling": {
                "enabled": True,
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
            },
            "pdb": {"minAvailable": 1},
            "networkPolicy": {
                "from": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}
                        }
                    }
                ],
            },
        },
    },
)
# the gateway's objects are named after the release's full name
GATEWAY = f"{FULLNAME}-gateway"


@functools.cache
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART_DIR)


class Rendered:
    """The objects of one rendering, and NOTES.txt."""

    def __init__(self, manifests: list[Manifest], notes: str) -> None:
        self.manifests = manifests
        self.notes = notes

    def kinds(self) -> list[str]:
        return sorted(str(m["kind"]) for m in self.manifests)

    def all(self, kind: str) -> list[Manifest]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name: str = FULLNAME) -> Manifest:
        found = [m for m in self.all(kind) if m["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {self.kinds()}"
        return found[0]

    @property
    def deployment(self) -> Manifest:
        return self.one("Deployment")

    @property
    def pod(self) -> Manifest:
        return cast(Manifest, self.deployment["spec"]["template"])

    @property
    def pod_spec(self) -> Manifest:
        return cast(Manifest, self.pod["spec"])

    @property
    def container(self) -> Manifest:
        containers = self.pod_spec["containers"]
        assert [c["name"] for c in containers] == ["worker"]
        return cast(Manifest, containers[0])

    @property
    def config(self) -> dict[str, str]:
        return cast(dict[str, str], self.one("ConfigMap")["data"])

    def env(self) -> dict[str, Manifest]:
        return {e["name"]: e for e in self.container["env"]}

    def volumes(self) -> dict[str, Manifest]:
        return {v["name"]: v for v in self.pod_spec["volumes"]}

    def mounts(self) -> dict[str, Manifest]:
        return {m["mountPath"]: m for m in self.container["volumeMounts"]}


def render(values: Mapping[str, Any] | None = None) -> Rendered:
    """Render as `helm template demo helm/trtllm-worker -n llm` with these values would."""
    files = chart().render(dict(values or {}), name=RELEASE, namespace=NAMESPACE)
    manifests: list[Manifest] = []
    notes = ""
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        manifests.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return Rendered(manifests, notes)


def render_error(values: Mapping[str, Any]) -> str:
    """The message of a rendering that must fail."""
    try:
        render(values)
    except helm_python.HelmError as exc:
        return str(exc)
    raise AssertionError(f"rendering succeeded with {values}")


def env_example_settings() -> set[str]:
    """Every WORKER_ variable .env.example names, set or commented out."""
    pattern = re.compile(r"^#?\s*(WORKER_[A-Z0-9_]+)=", re.MULTILINE)
    return set(pattern.findall(ENV_EXAMPLE.read_text(encoding="utf-8")))


def worker_settings() -> set[str]:
    """Every setting the worker reads (the source of truth .env.example follows)."""
    return {"WORKER_" + name.upper() for name in Settings.model_fields}


def chart_settings() -> set[str]:
    """The settings the chart must put in its ConfigMap: all but the two URLs."""
    return (env_example_settings() | worker_settings()) - URL_SETTINGS
