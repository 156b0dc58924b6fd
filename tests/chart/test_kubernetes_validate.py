"""Every rendered manifest validated against the Kubernetes API schemas, strictly (unknown
fields are errors), by kubernetes-validate. Its bundled schemas cover Kubernetes' own
kinds only: the custom resources (KEDA, Prometheus Operator) are checked here by hand."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from tests.chart.support import (
    ALL_ON,
    CHART_SECRET,
    EXISTING_SECRET,
    Manifest,
    merge,
    render,
)

# the chart's kubeVersion floor, the version production clusters run, the newest bundled
KUBERNETES_VERSIONS = ["1.25.0", "1.31.0", "1.37.0"]

CUSTOM_RESOURCES = {
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("keda.sh/v1alpha1", "TriggerAuthentication"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
}

SCENARIOS: dict[str, dict[str, Any]] = {
    "default": CHART_SECRET,
    "existing-secret": EXISTING_SECRET,
    "all-on": ALL_ON,
    "echo-cpu": merge(
        CHART_SECRET,
        {
            "config": {"WORKER_ENGINE": "echo"},
            "resources": {"limits": {"nvidia.com/gpu": None, "cpu": "2", "memory": "1Gi"}},
            "tolerations": [],
            "pdb": {"create": False},
            "serviceAccount": {"create": False},
            "model": {"hostPath": "/srv/models"},
        },
    ),
    # the gateway with its defaults (ALL_ON has every option of it)
    "gateway": merge(
        EXISTING_SECRET,
        {"gateway": {"enabled": True, "apiKeys": {"existingSecret": "gateway-keys"}}},
    ),
}


def validate(manifest: Manifest, version: str) -> None:
    """Raises kubernetes_validate.ValidationError for an invalid manifest."""
    kubernetes_validate.validate(manifest, version, strict=True)


def check_custom_resource(manifest: Manifest) -> None:
    """What the CRDs require of the objects the chart makes (KEDA 2.x, Prometheus
    Operator v1), without their schemas, which no offline package ships."""
    assert set(manifest) == {"apiVersion", "kind", "metadata", "spec"}
    assert {"name", "namespace", "labels"} <= set(manifest["metadata"])
    spec = manifest["spec"]
    kind = manifest["kind"]
    if kind == "ScaledObject":
        assert spec["scaleTargetRef"]["name"]
        assert isinstance(spec["minReplicaCount"], int)
        assert isinstance(spec["maxReplicaCount"], int)
        assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
        for trigger in spec["triggers"]:
            assert set(trigger) <= {"type", "metadata", "authenticationRef", "name", "metricType"}
            assert all(isinstance(v, str) for v in trigger["metadata"].values())
        assert set(spec["advanced"]["horizontalPodAutoscalerConfig"]) <= {"name", "behavior"}
    elif kind == "TriggerAuthentication":
        for ref in spec["secretTargetRef"]:
            assert set(ref) == {"parameter", "name", "key"}
    elif kind == "ServiceMonitor":
        assert spec["selector"]["matchLabels"]
        for endpoint in spec["endpoints"]:
            assert endpoint["port"]
            assert endpoint["path"].startswith("/")
    else:  # pragma: no cover - a new custom resource needs its own checks here
        raise AssertionError(f"no checks for {kind}")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_manifest_is_valid(scenario: str, version: str) -> None:
    rendered = render(SCENARIOS[scenario])
    assert rendered.manifests
    for manifest in rendered.manifests:
        key = (manifest["apiVersion"], manifest["kind"])
        if key in CUSTOM_RESOURCES:
            # explicitly: no bundled schema for a custom resource, so check it ourselves
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                validate(manifest, version)
            check_custom_resource(manifest)
            continue
        try:
            validate(manifest, version)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            raise AssertionError(f"{manifest['kind']} {path}: {exc.message}") from None


def test_the_validator_is_strict() -> None:
    # guards the test above: an unknown field or a wrong type in the Deployment fails
    deployment = render(CHART_SECRET).deployment
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePullPolice"):
        validate(typo, "1.31.0")
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "60"
    with pytest.raises(kubernetes_validate.ValidationError, match="not of type 'integer'"):
        validate(wrong_type, "1.31.0")
