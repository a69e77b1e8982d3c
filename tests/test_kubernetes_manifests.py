"""deploy/kubernetes/: every manifest valid offline against the Kubernetes schemas (kubernetes-validate;
the InferencePool, a CRD it does not know, against the CRD's published schema), the cross-references between them,
no secret value in any args, and the manifests' own args and probes run for real: a worker and a
scheduler started with the Deployments' args (secret paths pointed at test files), their probes
answered, and every metric name of the endpoint picker's configuration found in the live /metrics."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.certificates import CertificateAuthority
from tests.metrics_scrape import scrape
from tests.services_harness import REPO_ROOT, WORKER_SECRET, cli, free_port, stop, wait_until
from tests.test_services_e2e import model_with_tokenizer

FOLDER = REPO_ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"
# The Secrets the manifests mount (named in their header comments), each key made from a file of
# deploy/make-compose-secrets.sh (the report's `kubectl create secret` commands).
SECRET_KEYS_TO_FILES = {
    "nanovllm-worker-secret": {"worker_secret": "worker_secret"},
    "nanovllm-api-keys": {"api_keys": "api_keys"},
    "nanovllm-tls": {"tls.crt": "server.pem", "tls.key": "server.key", "ca.crt": "ca.pem"},
}
OUR_METRICS = {"queuedRequestsSpec": "nanovllm_num_requests_waiting",
               "runningRequestsSpec": "nanovllm_num_requests_running",
               "kvUsageSpec": "nanovllm_kv_cache_usage_ratio",
               "cacheInfoSpec": "nanovllm_cache_config_info"}


def load_documents() -> list[dict]:
    return [document for path in sorted(FOLDER.glob("*.yaml"))
            for document in yaml.safe_load_all(path.read_text()) if document]


DOCUMENTS = load_documents()


def of_kind(kind: str) -> list[dict]:
    return [document for document in DOCUMENTS if document["kind"] == kind]


def deployment(component: str) -> dict:
    [found] = [d for d in of_kind("Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return found


def container(component: str) -> dict:
    [found] = deployment(component)["spec"]["template"]["spec"]["containers"]
    return found


def service(name: str) -> dict:
    [found] = [s for s in of_kind("Service") if s["metadata"]["name"] == name]
    return found


def epp_config() -> dict:
    [config_map] = of_kind("ConfigMap")
    return yaml.safe_load(config_map["data"]["epp-config.yaml"])


def extractor_specs() -> dict[str, str]:
    """The metric specs of the engine the EPP's core-metrics-extractor maps every pod to."""
    [extractor] = [p for p in epp_config()["plugins"] if p["type"] == "core-metrics-extractor"]
    parameters = extractor["parameters"]
    [engine] = [e for e in parameters["engineConfigs"] if e["name"] == parameters["defaultEngine"]]
    return {key: value for key, value in engine.items() if key.endswith("Spec")}


def mounted_secret_files(component: str) -> dict[str, tuple[str, str]]:
    """{path in the container: (Secret, key)} of every Secret volume the container mounts."""
    pod = deployment(component)["spec"]["template"]["spec"]
    volume_to_secret = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    files = {}
    for mount in container(component)["volumeMounts"]:
        secret = volume_to_secret[mount["name"]]
        keys = [mount["subPath"]] if "subPath" in mount else list(SECRET_KEYS_TO_FILES[secret])
        for key in keys:
            path = mount["mountPath"] if "subPath" in mount else f"{mount['mountPath']}/{key}"
            files[path] = (secret, key)
    return files


def test_builtin_kinds_are_valid_against_the_kubernetes_schemas() -> None:
    builtin = [d for d in DOCUMENTS if d["apiVersion"] in ("v1", "apps/v1")]
    assert {d["kind"] for d in builtin} == {"Deployment", "Service", "ConfigMap"}
    for document in builtin:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_the_inference_pool_is_valid_against_the_crds_schema() -> None:
    """inference.networking.k8s.io/v1 InferencePool against the openAPIV3Schema of the CRD of
    gateway-api-inference-extension v1.6.0 (deploy/kubernetes/schemas/inferencepool-v1.json); its two
    CEL rules (unique target ports, a port for a Service picker) checked here by hand."""
    crd = json.loads((FOLDER / "schemas" / "inferencepool-v1.json").read_text())
    [pool] = of_kind("InferencePool")
    assert pool["apiVersion"] == f"{crd['group']}/{crd['version']}"
    jsonschema.Draft7Validator(crd["openAPIV3Schema"]).validate(pool)
    spec = pool["spec"]
    assert set(spec) <= set(crd["openAPIV3Schema"]["properties"]["spec"]["properties"])
    numbers = [port["number"] for port in spec["targetPorts"]]
    assert len(set(numbers)) == len(numbers)
    assert spec["endpointPickerRef"].get("kind", "Service") != "Service" or "port" in spec["endpointPickerRef"]
    assert spec["selector"]["matchLabels"] == deployment("scheduler")["spec"]["template"]["metadata"]["labels"]
    assert set(numbers) <= {port["containerPort"] for port in container("scheduler")["ports"]}


def test_the_schema_catches_a_broken_pool() -> None:
    crd = json.loads((FOLDER / "schemas" / "inferencepool-v1.json").read_text())
    [pool] = of_kind("InferencePool")
    broken = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 70000}]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(crd["openAPIV3Schema"]).validate(broken)
    missing = {**pool, "spec": {key: value for key, value in pool["spec"].items() if key != "selector"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(crd["openAPIV3Schema"]).validate(missing)


def test_services_select_their_deployments_and_name_existing_ports() -> None:
    for component in ("worker", "scheduler"):
        labels = deployment(component)["spec"]["template"]["metadata"]["labels"]
        assert deployment(component)["spec"]["selector"]["matchLabels"] == labels
        target = service(f"nanovllm-{component}")
        assert target["spec"]["selector"].items() <= labels.items()
        names = {port["name"] for port in container(component)["ports"]}
        assert {port["targetPort"] for port in target["spec"]["ports"]} <= names
    # h2c: cleartext HTTP/2, the worker port; the scheduler's public port has TLS, so it is not h2c
    assert [p["appProtocol"] for p in service("nanovllm-worker")["spec"]["ports"]] == ["kubernetes.io/h2c"]
    assert "appProtocol" not in service("nanovllm-scheduler")["spec"]["ports"][0]


def test_probes_reach_declared_ports() -> None:
    worker = container("worker")
    worker_ports = {port["containerPort"] for port in worker["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["grpc"]["port"] in worker_ports
    scheduler = container("scheduler")
    for probe in ("readinessProbe", "livenessProbe"):
        command = scheduler[probe]["exec"]["command"]
        assert command[:3] == ["nanovllm", "health", "--target"]
        assert int(command[3].rsplit(":", 1)[1]) in {port["containerPort"] for port in scheduler["ports"]}
        assert command[command.index("--ca-cert") + 1] in mounted_secret_files("scheduler")


def test_the_scheduler_dials_the_worker_service() -> None:
    args = container("scheduler")["args"]
    host, port = args[args.index("--worker") + 1].split(":")
    assert service(host)["spec"]["ports"][0]["port"] == int(port)


def test_secrets_come_from_documented_secrets_as_files() -> None:
    script = (REPO_ROOT / "deploy" / "make-compose-secrets.sh").read_text()
    for component in ("worker", "scheduler"):
        source = next(FOLDER.glob(f"{component}.yaml")).read_text()
        files = mounted_secret_files(component)
        for secret, key in files.values():
            assert key in SECRET_KEYS_TO_FILES[secret]
            assert f"Secret {secret}" in source, f"{component}.yaml's comment names no Secret {secret}"
            assert SECRET_KEYS_TO_FILES[secret][key] in script
        assert "env" not in container(component) and "envFrom" not in container(component)
        args = container(component)["args"]
        for flag, value in zip(args, args[1:], strict=False):
            if flag.startswith("--") and re.search("secret|key|cert", flag):
                assert value in files, f"{component}: {flag} {value} is not a file of a mounted Secret"


def test_args_hold_no_secret_value(tmp_path: Path) -> None:
    subprocess.run(["bash", str(REPO_ROOT / "deploy" / "make-compose-secrets.sh"), str(tmp_path)], check=True,
                   capture_output=True)
    values = [(tmp_path / name).read_text().strip() for name in ("api_keys", "worker_secret")]
    key_body = "".join((tmp_path / "server.key").read_text().splitlines()[1:-1])
    for component in ("worker", "scheduler"):
        text = " ".join(container(component)["args"])
        assert not any(value in text for value in values) and key_body[:40] not in text
        assert not re.search(r"[0-9a-f]{32}", text) and "BEGIN" not in text


def test_the_picker_names_our_metrics() -> None:
    specs = extractor_specs()
    assert {name: specs[name] for name in OUR_METRICS} == OUR_METRICS
    assert extractor_specs()["loraSpec"] == ""  # no LoRA metric: the vLLM default would be looked for
    config = epp_config()
    plugin_types = {plugin["type"] for plugin in config["plugins"]}
    referenced = {ref["pluginRef"] for profile in config["schedulingProfiles"] for ref in profile["plugins"]}
    for source in config["dataLayer"]["sources"]:
        referenced |= {source["pluginRef"], *(extractor["pluginRef"] for extractor in source["extractors"])}
    assert referenced <= plugin_types and "dataLayer" in config["featureGates"]


def translated(args: list[str], replacements: dict[str, str]) -> list[str]:
    return [replacements.get(arg, arg) for arg in args]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The manifests' worker and scheduler args, run: secret paths -> test files, ports -> free ones."""
    folder = tmp_path_factory.mktemp("kubernetes")
    model = model_with_tokenizer(folder, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    authority = CertificateAuthority("kubernetes test CA")
    server = authority.issue("localhost", server=True)
    contents = {"worker_secret": WORKER_SECRET, "api_keys": "test-api-key-0123", "tls.crt": server.cert,
                "tls.key": server.key, "ca.crt": authority.cert_pem}
    paths = {}
    for component in ("worker", "scheduler"):
        for mount_path, (_, key) in mounted_secret_files(component).items():
            path = folder / key
            data = contents[key]
            path.write_bytes(data if isinstance(data, bytes) else data.encode())
            paths[mount_path] = str(path)
    ports = {"50061": str(free_port()), "50051": str(free_port()), "8000": str(free_port())}
    worker_args = translated(container("worker")["args"], {**paths, **ports, "0.0.0.0": "127.0.0.1"})
    worker_args[worker_args.index("--model") + 1] = str(model)
    worker = cli(*worker_args, "--device", "cpu", "--block-size", "16", "--num-kv-blocks", "64")
    scheduler_args = translated(container("scheduler")["args"],
                                {**paths, **ports, "0.0.0.0": "127.0.0.1",
                                 "nanovllm-worker:50061": f"127.0.0.1:{ports['50061']}"})
    scheduler = cli(*scheduler_args)
    probe = translated(container("scheduler")["readinessProbe"]["exec"]["command"],
                       {**paths, "127.0.0.1:50051": f"127.0.0.1:{ports['50051']}"})
    try:
        def probe_passes() -> bool:
            return subprocess.run([sys.executable, "-m", "launch.cli", *probe[1:]], cwd=REPO_ROOT,
                                  capture_output=True).returncode == 0
        wait_until(probe_passes, timeout=90, what="the scheduler's readiness probe")
        yield {"ports": ports, "worker": worker, "scheduler": scheduler}
    finally:
        stop(scheduler)
        stop(worker)


def test_the_worker_port_answers_health_in_plaintext_without_credentials(live: dict) -> None:
    """What the kubelet's native gRPC probe does: grpc.health.v1 Check, plaintext, no metadata."""
    with grpc.insecure_channel(f"127.0.0.1:{live['ports']['50061']}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_every_metric_the_picker_reads_is_in_the_live_metrics(live: dict) -> None:
    samples = scrape(int(live["ports"]["8000"]))
    for spec in extractor_specs().values():
        if not spec:
            continue
        name = spec.split("{", 1)[0]
        assert name in {sample for sample, _ in samples}, f"{name} not in /metrics"
    cache_labels = [dict(labels) for sample, labels in samples if sample == "nanovllm_cache_config_info"]
    assert cache_labels and all(labels["block_size"] == "16" and labels["num_gpu_blocks"] == "64"
                                for labels in cache_labels)
