"""deploy/kubernetes: every manifest valid against the Kubernetes schemas (kubernetes-validate ships
them: no network), and consistent with the server it runs: arguments its parser accepts, probes on
its routes, a grace period longer than its drain and shutdown, an autoscaler on a metric it exports."""

from __future__ import annotations

import argparse
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ouro_fast.server.config import ServerConfig, env_name
from ouro_fast.server.launch import add_serve_args
from ouro_fast.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "deploy/kubernetes").glob("*.yaml"))
KUBERNETES_VERSION = "1.29"


def documents() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def one(kind: str) -> dict:
    (doc,) = [d for d in documents() if d["kind"] == kind]
    return doc


def server_container() -> dict:
    (container,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def serve_config(args: list[str]) -> ServerConfig:
    """The ServerConfig `ouro-fast serve` would build from these arguments."""
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    parsed = parser.parse_args(args)  # an unknown or malformed option exits here
    environ = {env_name(name): str(value) for name, value in vars(parsed).items() if value is not None}
    return ServerConfig.from_env(environ)


def test_the_manifests_are_there():
    kinds = {d["kind"] for d in documents()}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PersistentVolumeClaim"} <= kinds


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}-{d['metadata']['name']}")
def test_manifest_is_valid_kubernetes(doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_schema_validation_catches_a_mistake():
    doc = one("Deployment")
    doc["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 150  # misspelled field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_container_runs_ouro_fast_serve_with_valid_options():
    container = server_container()
    assert container["command"] == ["ouro-fast", "serve"]
    config = serve_config(container["args"])
    mount = next(m for m in container["volumeMounts"] if config.model.startswith(m["mountPath"] + "/"))
    assert mount["readOnly"]
    with pytest.raises(SystemExit):
        serve_config([*container["args"], "--drain-dealy=3"])


def test_one_gpu_per_pod_and_resource_requests():
    resources = server_container()["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert {"cpu", "memory"} <= set(resources["requests"])


def test_probes_and_the_termination_grace_fit_the_server():
    container = server_container()
    config = serve_config(container["args"])
    port = next(p for p in container["ports"] if p["name"] == "http")["containerPort"]
    assert f"--port={port}" in container["args"]
    # Readiness is /health (503 while loading, draining, out of service); liveness any answer.
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/version"
    # The pod is killed only after the drain delay and the grace period for streams in flight.
    grace = one("Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert config.drain_delay > 0
    assert grace > config.drain_delay + config.shutdown_grace
    # The readiness probe notices the drain within it, for balancers that follow readiness.
    probe = container["readinessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] < config.drain_delay


def test_the_service_selects_the_pods():
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = one("Service")["spec"]["selector"]
    assert selector.items() <= labels.items()


def test_the_autoscaler_reads_a_metric_the_server_exports():
    (metric,) = one("HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["type"] == "Pods"
    rules = yaml.safe_load(one("ConfigMap")["data"]["config.yaml"])["rules"]
    (rule,) = [r for r in rules if r["name"]["as"] == metric["pods"]["metric"]["name"]]
    series = rule["seriesQuery"].split("{")[0]
    assert series == "vllm:num_requests_waiting"
    exported = ServerMetrics("ouro-1.4b").render().decode()
    assert f"\n{series}{{" in exported
