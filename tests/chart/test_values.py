"""values.yaml, values.schema.json, the chart's README and `helm lint` agree with each
other and with the worker's settings."""

from __future__ import annotations

import json
import re
from typing import Any

import helm_python
import pytest
import yaml

from tests.chart.support import (
    ALL_ON,
    CHART_DIR,
    CHART_SECRET,
    EXISTING_SECRET,
    chart,
    chart_settings,
    merge,
    render_error,
)

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text(encoding="utf-8"))
VALUES_TEXT = (CHART_DIR / "values.yaml").read_text(encoding="utf-8")
README = (CHART_DIR / "README.md").read_text(encoding="utf-8")


def schema_error(values: dict[str, Any]) -> str:
    """Helm's own check of the merged values against values.schema.json."""
    try:
        chart().validate_schema(chart().merge_values(values))
    except helm_python.HelmValuesError as exc:
        return str(exc)
    raise AssertionError(f"the schema accepted {values}")


@pytest.mark.parametrize(
    "values",
    [{}, CHART_SECRET, EXISTING_SECRET, ALL_ON],
    ids=["defaults", "secret", "existing", "all-on"],
)
def test_schema_accepts(values: dict[str, Any]) -> None:
    chart().validate_schema(chart().merge_values(values))


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"replicas": 2}, "additional properties 'replicas' not allowed"),
        ({"gpu": 1}, "additional properties 'gpu' not allowed"),
        ({"replicaCount": "two"}, "/replicaCount': got string, want integer"),
        ({"keda": {"enabled": "yes"}}, "/keda/enabled': got string, want boolean"),
        ({"config": {"WORKER_MAX_BATCH": "lots"}}, "/config/WORKER_MAX_BATCH': got string"),
        ({"config": {"WORKER_MAXBATCH": 8}}, "additional properties 'WORKER_MAXBATCH' not allowed"),
        ({"config": {"WORKER_ENGINE": "vllm"}}, "/config/WORKER_ENGINE"),
        ({"config": {"WORKER_HTTP_PORT": 0}}, "/config/WORKER_HTTP_PORT"),
        ({"config": {"WORKER_KV_CACHE_FREE_GPU_MEMORY_FRACTION": 1.5}}, "FRACTION"),
        ({"config": {"WORKER_AMQP_URL": "amqp://a:b@c/"}}, "'WORKER_AMQP_URL' not allowed"),
        ({"config": {"WORKER_REDIS_URL": "redis://c/"}}, "'WORKER_REDIS_URL' not allowed"),
        ({"secrets": {"amqpUrl": "http://rabbitmq:15672/"}}, "/secrets/amqpUrl"),
        ({"secrets": {"redisUrl": "valkey://r/"}}, "/secrets/redisUrl"),
        ({"terminationGraceExtraSeconds": 0}, "/terminationGraceExtraSeconds"),
        ({"image": {"digest": "latest"}}, "/image/digest"),
        ({"image": {"tag": 1.2}}, "/image/tag"),
        ({"shm": {"sizeLimit": "lots"}}, "/shm/sizeLimit"),
        ({"pdb": {"maxUnavailable": "half"}}, "/pdb/maxUnavailable"),
        ({"livenessProbe": {"successThreshold": 2}}, "/livenessProbe/successThreshold"),
        ({"model": {"mountPath": "models"}}, "/model/mountPath"),
        ({"keda": {"queueLength": "many"}}, "/keda/queueLength"),
        ({"tracing": {"protocol": "http/json"}}, "/tracing/protocol"),
        ({"networkPolicy": {"enabled": "yes"}}, "/networkPolicy/enabled"),
        ({"networkPolicy": {"redis": {"ports": [70000]}}}, "/networkPolicy/redis/ports"),
        ({"tracing": {"endpoint": "otel:4317"}}, "/tracing/endpoint"),
        ({"tracing": {"samplerArg": "10%"}}, "/tracing/samplerArg"),
        ({"tracing": {"env": {"WORKER_QUEUE": "x"}}}, "does not match pattern '^OTEL_"),
    ],
)
def test_schema_rejects(values: dict[str, Any], expected: str) -> None:
    assert expected in schema_error(values)


def test_install_refuses_values_the_schema_rejects() -> None:
    # Helm checks the schema before rendering (install, upgrade, template)
    message = render_error(merge(CHART_SECRET, {"replicas": 3}))
    assert "additional properties 'replicas' not allowed" in message


def test_top_level_is_closed() -> None:
    assert SCHEMA["additionalProperties"] is False
    declared = set(SCHEMA["properties"]) - {"global"}
    assert declared == set(chart().values)


def test_config_names_every_setting_but_the_urls() -> None:
    config_schema = SCHEMA["properties"]["config"]
    assert config_schema["additionalProperties"] is False
    assert set(config_schema["properties"]) == chart_settings()
    assert set(chart().values["config"]) == chart_settings()


def _leaves(values: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            paths.extend(_leaves(value, path + "."))
        else:
            paths.append(path)
    return paths


def _params() -> list[str]:
    return re.findall(r"^## @param (\S+)", VALUES_TEXT, re.MULTILINE)


def test_every_value_is_described_in_values_yaml() -> None:
    # bitnami convention: a `## @param` for each value, or for an object holding it
    params = set(_params())
    values = yaml.safe_load(VALUES_TEXT)
    for leaf in _leaves(values):
        parts = leaf.split(".")
        covered = {".".join(parts[: n + 1]) for n in range(len(parts))}
        assert covered & params, f"values.yaml: no ## @param for {leaf}"
    for param in params:
        node: Any = values
        for part in param.split("."):
            assert isinstance(node, dict), param
            assert part in node, f"## @param {param} names no value"
            node = node[part]


def test_chart_readme_documents_every_value() -> None:
    missing = [p for p in _params() if f"`{p}`" not in README]
    assert not missing, f"helm/trtllm-worker/README.md does not document {missing}"


@pytest.mark.parametrize(
    "values", [CHART_SECRET, EXISTING_SECRET, ALL_ON], ids=["secret", "existing", "all-on"]
)
@pytest.mark.parametrize("kube_version", ["v1.25.0", "v1.31.0"])
def test_helm_lint_strict(values: dict[str, Any], kube_version: str) -> None:
    report = helm_python.lint(CHART_DIR, values, strict=True, kube_version=kube_version)
    assert report["errors"] == []
    # severity 1 is information ("icon is recommended"); 2 warning, 3 error
    assert [m for m in report["messages"] if m["severity"] > 1] == []
    assert report["total_charts_linted"] == 1


def test_chart_metadata() -> None:
    metadata = chart().metadata
    assert metadata["apiVersion"] == "v2"
    assert metadata["name"] == "trtllm-worker"
    assert metadata["kubeVersion"] == ">=1.25.0-0"
    pyproject = (CHART_DIR.parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    version = re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE)
    assert version is not None
    assert metadata["appVersion"] == version.group(1)
