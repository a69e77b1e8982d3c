"""`nanovllm`'s start-up checks and help: every --worker address and --model / --tokenizer path is
checked before anything starts (one line naming the flag and value, exit 2), hub ids come from the
local Hugging Face cache only, --help shows required flags and no empty defaults, and the global
flags may follow the subcommand."""
from __future__ import annotations

from pathlib import Path

import pytest

from launch.cli import build_parser, checked_worker_config, main, worker_addresses
from tests.services_harness import run_cli

FORMS = "(give host:port, [ipv6]:port or unix:/path)"


def lay_out_hub_cache(cache: Path, repo_id: str, files: dict[str, str], commit: str = "0123abcd") -> Path:
    """A Hugging Face hub cache holding repo_id at `commit` (refs/main), as huggingface_hub lays it out;
    returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.mark.parametrize(("address", "problem"), [
    ("nohost", "no port"),
    ("127.0.0.1", "no port"),
    ("127.0.0.1:", "no port"),
    ("http://127.0.0.1:50061", "a URL, not an address (gRPC takes no http:// scheme)"),
    ("127.0.0.1:99999", "port 99999 is not in [1, 65535]"),
    ("127.0.0.1:0", "port 0 is not in [1, 65535]"),
    ("127.0.0.1:http", "port 'http' is not a number"),
    (":50061", "no host"),
    ("::1:50061", "an IPv6 address goes in brackets, [address]:port"),
    ("[::1]", "no port"),
    ("[nohost]:50061", "'nohost' is not an IPv6 address"),
    ("unix:", "no socket path after unix:"),
    ("my host:50061", "'my host' is not a host name or address"),
])
def test_a_malformed_worker_address_is_refused_naming_it(address: str, problem: str) -> None:
    with pytest.raises(ValueError) as raised:
        worker_addresses(f"127.0.0.1:50061,{address}")
    assert str(raised.value) == f"--worker: {address}: {problem} {FORMS}"


def test_well_formed_worker_addresses_are_kept_in_order() -> None:
    value = "127.0.0.1:50061, worker-1.example:1 ,[::1]:65535,[fe80::1]:7,unix:/tmp/w.sock,unix:///tmp/x"
    assert worker_addresses(value) == ("127.0.0.1:50061", "worker-1.example:1", "[::1]:65535", "[fe80::1]:7",
                                       "unix:/tmp/w.sock", "unix:///tmp/x")
    with pytest.raises(ValueError, match=r"^--worker: ' , ' names no address"):
        worker_addresses(" , ")


@pytest.mark.parametrize("address", ["nohost", "127.0.0.1", "http://127.0.0.1:50061", "127.0.0.1:99999"])
def test_the_scheduler_exits_2_on_a_malformed_worker_address_before_starting(address: str) -> None:
    result = run_cli("scheduler", "--worker", address, "--port", "0", timeout=60)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"nanovllm scheduler: --worker: {address}: ")
    assert result.stderr.endswith(f" {FORMS}\n") and result.stderr.count("\n") == 1


@pytest.mark.parametrize(("args", "flag"), [
    (["serve", "--model"], "--model"),
    (["worker", "--model"], "--model"),
    (["scheduler", "--worker", "127.0.0.1:50061", "--tokenizer"], "--tokenizer"),
])
def test_a_missing_model_path_exits_2_naming_the_flag(tmp_path: Path, args: list[str], flag: str) -> None:
    missing = tmp_path / "no-such-model"
    result = run_cli(*args, str(missing), "--port", "0", timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (
        2, "", f"nanovllm {args[0]}: {flag}: {missing} does not exist\n")


def test_a_model_path_that_holds_no_checkpoint_exits_2(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    result = run_cli("serve", "--model", str(tmp_path), timeout=60)
    assert (result.returncode, result.stderr) == (
        2, f"nanovllm serve: --model: {tmp_path} holds neither config.json nor a single .gguf file\n")
    result = run_cli("worker", "--model", str(tmp_path / "notes.txt"), timeout=60)
    assert (result.returncode, result.stderr) == (
        2, f"nanovllm worker: --model: {tmp_path / 'notes.txt'} is a file but not a .gguf file "
           "(give its folder or a .gguf file)\n")


def test_a_hub_id_not_in_the_local_cache_says_how_to_get_it(hub_cache: Path) -> None:
    for command in (["serve"], ["worker"]):
        result = run_cli(*command, "--model", "Qwen/Qwen3-0.6B", timeout=60)
        assert (result.returncode, result.stdout, result.stderr) == (2, "", (
            f"nanovllm {command[0]}: --model: Qwen/Qwen3-0.6B is not a path and not in the local Hugging Face "
            f"cache ({hub_cache}); nothing is downloaded: get it with `hf download Qwen/Qwen3-0.6B` (or "
            "`huggingface-cli download Qwen/Qwen3-0.6B`), or give a checkpoint folder or .gguf file\n"))
    assert list(hub_cache.iterdir()) == []  # nothing fetched, not even metadata


def test_a_hub_id_in_the_local_cache_is_its_snapshot_folder(hub_cache: Path) -> None:
    snapshot = lay_out_hub_cache(hub_cache, "org/name", {"config.json": "{}"})
    args = build_parser().parse_args(["worker", "--model", "org/name"])
    assert checked_worker_config(args).model == str(snapshot)
    tokenizer = lay_out_hub_cache(hub_cache, "org/tok", {"tokenizer.json": "{}"})
    args = build_parser().parse_args(["scheduler", "--worker", "w:1", "--tokenizer", "org/tok"])
    from launch.cli import tokenizer_path

    assert tokenizer_path(args) == str(tokenizer)


def test_hf_home_locates_the_cache_when_hf_hub_cache_is_unset(tmp_path: Path, monkeypatch) -> None:
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snapshot = lay_out_hub_cache(tmp_path / "home" / "hub", "org/name", {"model.gguf": ""})
    args = build_parser().parse_args(["worker", "--model", "org/name"])
    assert checked_worker_config(args).model == str(snapshot)  # a snapshot of one .gguf file: its folder
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))
    legacy = lay_out_hub_cache(tmp_path / "legacy", "org/name", {"config.json": "{}"}, commit="feed")
    assert checked_worker_config(args).model == str(legacy)


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return capsys.readouterr().out


@pytest.fixture
def wide_help(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag


@pytest.mark.parametrize("command", ["worker", "scheduler", "serve", "health"])
def test_help_shows_no_empty_default(command: str, capsys, wide_help) -> None:
    text = _help(command, capsys)
    assert "(default: None)" not in text and "(default: )" not in text
    assert "(default: 50051)" in text or command in ("worker", "health")  # real defaults stay


def test_scheduler_help_shows_worker_as_required(capsys, wide_help) -> None:
    (line,) = [line for line in _help("scheduler", capsys).splitlines() if line.strip().startswith("--worker WORKER")]
    assert line.endswith("(required)")
    parser = build_parser()
    scheduler = next(a for a in parser._subparsers._group_actions[0].choices["scheduler"]._actions  # type: ignore
                     if a.dest == "worker")
    assert scheduler.required


def test_each_side_of_the_worker_link_says_its_own_meaning_of_its_ca(capsys, wide_help) -> None:
    worker = " ".join(_help("worker", capsys).split())
    assert ("--tls-client-ca TLS_CLIENT_CA PEM CA bundle: require scheduler certificates it signed (mutual TLS; "
            "with --tls-cert and --tls-key)") in worker
    scheduler = " ".join(_help("scheduler", capsys).split())
    assert ("--worker-tls-ca WORKER_TLS_CA PEM CA that signs the workers' certificates: dial them over TLS "
            "(not given: plaintext) --") in scheduler


@pytest.mark.parametrize(("argv", "level", "log_format"), [
    (["serve"], "INFO", "text"),
    (["serve", "--log-level", "DEBUG"], "DEBUG", "text"),
    (["--log-level", "ERROR", "serve"], "ERROR", "text"),
    (["--log-level", "ERROR", "worker", "--log-level", "WARNING", "--log-format", "json"], "WARNING", "json"),
    (["scheduler", "--worker", "w:1", "--log-format", "json"], "INFO", "json"),
    (["health", "--log-level", "DEBUG"], "DEBUG", "text"),
])
def test_global_flags_are_taken_before_and_after_the_subcommand(argv: list[str], level: str, log_format: str) -> None:
    args = build_parser().parse_args(argv)
    assert (args.log_level, args.log_format) == (level, log_format)


def test_a_global_flag_after_the_subcommand_is_accepted_and_checked() -> None:
    result = run_cli("scheduler", "--worker", "nohost", "--log-level", "DEBUG", timeout=60)
    assert result.returncode == 2 and "--worker: nohost: no port" in result.stderr  # parsed, not refused
    result = run_cli("scheduler", "--log-format", "xml", "--worker", "w:1", timeout=60)
    assert result.returncode == 2 and "invalid choice: 'xml'" in result.stderr


def test_main_returns_2_for_usage_errors(capsys) -> None:
    assert main(["scheduler", "--worker", "127.0.0.1", "--log-level", "ERROR"]) == 2
    assert capsys.readouterr().err == f"nanovllm scheduler: --worker: 127.0.0.1: no port {FORMS}\n"
