"""vllm.grpc.engine.VllmEngine on the public port, through smg-grpc-proto's own stubs over a real
channel: against a real worker on a tiny model (every RPC; greedy ids equal to our own API's,
chunks joining to the unary answer, usage, stops, Abort freeing the request, KV events) and against
the scripted engine (refusals by field name, API keys, mTLS, draining, health and reflection for the
service name)."""
from __future__ import annotations

import io
import threading
import zipfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc
from tokenizers import Tokenizer as BackendTokenizer

from common.contract.config import PublicServerConfig
from common.generated.nanovllm.generate.v1 import generate_pb2, generate_pb2_grpc
from common.security.api_keys import ApiKeys
from scheduler_service.api.tokenizer import load_tokenizer
from scheduler_service.api.vllm.kv_events import signed_hash
from scheduler_service.api.vllm.servicer import SERVICE_NAME
from scheduler_service.core.block_manager import NO_PARENT_HASH, chain_hash
from scheduler_service.observe.load_report import LoadReport
from tests.certificates import CertificateAuthority
from tests.scheduler_service.public_server_harness import FakeEngine, ServerThread, save_tiny_tokenizer
from tests.services_harness import InProcessScheduler, free_port, start_worker, stop, wait_until
from tests.tiny_models import make_tiny_checkpoint, save_tiny_bpe_tokenizer

BLOCK_SIZE = 16  # tests.services_harness.WORKER_OPTIONS
KEY = "vllm-key-0123456789abcdef"
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog, and then the fox runs far away."


def generate_request(input_ids: list[int], stream: bool = False, request_id: str = "", **sampling) \
        -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest(
        request_id=request_id, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=input_ids), stream=stream,
        sampling_params=vllm_engine_pb2.SamplingParams(**sampling))


def split(responses: list[vllm_engine_pb2.GenerateResponse]) \
        -> tuple[list[vllm_engine_pb2.GenerateStreamChunk], vllm_engine_pb2.GenerateComplete]:
    """The chunks, and the one complete that must end the stream."""
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[-1] == "complete" and kinds.count("complete") == 1, kinds
    return [r.chunk for r in responses[:-1]], responses[-1].complete


# A real worker on a tiny model.

@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("vllm"), "qwen3", max_position_embeddings=1024)
    save_tiny_bpe_tokenizer(model)
    port = free_port()
    worker = start_worker(model, port)
    try:
        scheduler = InProcessScheduler(model, port).start()
        try:
            scheduler.run(scheduler.engine.wait_ready(timeout=120))
            yield scheduler
        finally:
            scheduler.stop()
    finally:
        stop(worker)


@pytest.fixture(scope="module")
def channel(scheduler: InProcessScheduler):
    with grpc.insecure_channel(scheduler.target) as channel:
        yield channel


@pytest.fixture(scope="module")
def vllm(channel: grpc.Channel) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
def prompt_ids(scheduler: InProcessScheduler) -> list[int]:
    ids = load_tokenizer(str(scheduler.model)).encode(PROMPT_TEXT)
    assert len(ids) > BLOCK_SIZE  # a full block, for the prefix cache
    return ids


def test_greedy_ids_equal_our_api_and_chunks_join_to_the_unary_answer(scheduler, channel, vllm, prompt_ids) -> None:
    ours = generate_pb2_grpc.TextGenerationStub(channel).Generate(generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt_ids), temperature=0, max_tokens=20, ignore_eos=True), timeout=60)
    request = dict(temperature=0, max_tokens=20, ignore_eos=True)
    (unary,) = list(vllm.Generate(generate_request(prompt_ids, **request), timeout=60))
    assert unary.complete.output_ids == ours.token_ids and len(ours.token_ids) == 20
    assert unary.complete.finish_reason == "length"
    assert (unary.complete.prompt_tokens, unary.complete.completion_tokens) == (len(prompt_ids), 20)
    chunks, complete = split(list(vllm.Generate(generate_request(prompt_ids, stream=True, **request), timeout=60)))
    assert [t for c in chunks for t in c.token_ids] == list(complete.output_ids) == list(ours.token_ids)
    assert [c.completion_tokens for c in chunks] == [sum(len(c.token_ids) for c in chunks[:i + 1])
                                                     for i in range(len(chunks))]  # running counts
    assert all(c.prompt_tokens == len(prompt_ids) for c in chunks)
    assert complete.cached_tokens >= BLOCK_SIZE  # the same prompt again: its full blocks come from the cache
    assert (complete.completion_tokens, complete.finish_reason) == (20, "length")


def test_text_input_logprobs_and_the_request_counts_in_our_metrics(scheduler, vllm) -> None:
    metrics = scheduler.metrics
    before = metrics.registry.get_sample_value("nanovllm_request_success_total", {"finish_reason": "length"}) or 0
    (response,) = list(vllm.Generate(vllm_engine_pb2.GenerateRequest(
        text=PROMPT_TEXT, sampling_params=vllm_engine_pb2.SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)), timeout=60))
    logprobs = response.complete.output_logprobs
    assert list(logprobs.token_ids) == list(response.complete.output_ids) and len(logprobs.token_logprobs) == 4
    assert [len(top.token_ids) for top in logprobs.top_logprobs] == [2] * 4
    assert logprobs.top_logprobs[0].token_ids[0] == logprobs.token_ids[0]  # greedy: the best one
    after = metrics.registry.get_sample_value("nanovllm_request_success_total", {"finish_reason": "length"})
    assert after == before + 1


def test_stop_strings_stop_ids_and_max_tokens(scheduler, vllm, prompt_ids) -> None:
    (free,) = list(vllm.Generate(generate_request(prompt_ids, temperature=0, max_tokens=30, ignore_eos=True),
                                 timeout=60))
    tokenizer = load_tokenizer(str(scheduler.model))
    text = tokenizer.decode(list(free.complete.output_ids))
    stop_text = text[len(text) // 2:][:3]
    assert stop_text.strip()
    (stopped,) = list(vllm.Generate(generate_request(prompt_ids, temperature=0, max_tokens=30, ignore_eos=True,
                                                     stop=[stop_text]), timeout=60))
    assert stopped.complete.finish_reason == "stop" and stopped.complete.matched_stop_str == stop_text
    assert 0 < stopped.complete.completion_tokens < 30
    assert list(stopped.complete.output_ids) == list(free.complete.output_ids[:stopped.complete.completion_tokens])
    stop_id = free.complete.output_ids[5]
    (by_id,) = list(vllm.Generate(generate_request(prompt_ids, temperature=0, max_tokens=30, ignore_eos=True,
                                                   stop_token_ids=[stop_id]), timeout=60))
    assert by_id.complete.finish_reason == "stop" and by_id.complete.matched_token_id == stop_id
    assert by_id.complete.output_ids[-1] == stop_id
    (short,) = list(vllm.Generate(generate_request(prompt_ids, temperature=0, max_tokens=3, ignore_eos=True),
                                  timeout=60))
    assert (short.complete.completion_tokens, short.complete.finish_reason) == (3, "length")


def test_abort_ends_the_stream_and_frees_the_request(scheduler, vllm, prompt_ids) -> None:
    stream = vllm.Generate(generate_request(prompt_ids, stream=True, request_id="to-abort", temperature=0,
                                            max_tokens=900, ignore_eos=True), timeout=120)
    first = next(stream)
    assert first.WhichOneof("response") == "chunk"
    vllm.Abort(vllm_engine_pb2.AbortRequest(request_ids=["to-abort", "unknown-id"]), timeout=10)
    chunks, complete = split([first, *stream])
    assert complete.finish_reason == "abort"
    assert list(complete.output_ids) == [t for c in chunks for t in c.token_ids]
    assert complete.completion_tokens < 900
    engine = scheduler.engine
    wait_until(lambda: engine.num_unfinished == 0 and all(s.num_running == 0 for _, s in engine.worker_stats()),
               timeout=10, what="the aborted request to leave the engine")
    assert len(scheduler.public.vllm.aborts) == 0


def test_management_rpcs(scheduler, channel, vllm, prompt_ids) -> None:
    for _ in range(2):  # the second finds the first's full blocks in the prefix cache
        list(vllm.Generate(generate_request(prompt_ids, temperature=0, max_tokens=2), timeout=60))
    health = vllm.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=10)
    assert health.healthy
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    info = vllm.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=10)
    served = scheduler.engine.model_info
    assert (info.max_context_length, info.vocab_size, info.is_generation) == (served.max_model_len,
                                                                              served.vocab_size, True)
    assert info.served_model_name == scheduler.model.name and list(info.eos_token_ids) == list(served.eos_token_ids)
    server = vllm.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=10)
    assert (server.data_parallel_size, server.block_size, server.is_paused) == (1, BLOCK_SIZE, False)
    loads = vllm.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=10)
    ((_, stats),) = scheduler.engine.worker_stats()
    (load,) = loads.loads
    assert (loads.dp_rank_count, load.max_total_num_tokens) == (1, stats.num_kv_blocks * BLOCK_SIZE)
    assert (load.num_running_reqs, load.num_used_tokens) == (0, 0)  # idle: cached blocks count as free
    assert load.cache_hit_rate > 0
    metrics = scheduler.metrics
    metrics.set_load_source(lambda: LoadReport.of(scheduler.engine.worker_stats()))
    labels = {"worker": scheduler.worker_address, "block_size": str(BLOCK_SIZE),
              "num_gpu_blocks": str(stats.num_kv_blocks)}
    assert metrics.registry.get_sample_value("nanovllm_cache_config_info", labels) == 1  # what llm-d's picker reads
    with pytest.raises(grpc.RpcError) as error:
        vllm.Embed(vllm_engine_pb2.EmbedRequest(), timeout=10)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED and "Embed" in error.value.details()


def test_get_tokenizer_bundle_loads_and_tokenizes_as_we_do(scheduler, vllm) -> None:
    chunks = list(vllm.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    assert chunks[-1].sha256 and all(not c.sha256 for c in chunks[:-1])
    archive = zipfile.ZipFile(io.BytesIO(b"".join(c.data for c in chunks)))
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(archive.namelist())
    backend = BackendTokenizer.from_str(archive.read("tokenizer.json").decode())
    assert backend.encode(PROMPT_TEXT).ids == load_tokenizer(str(scheduler.model)).encode(PROMPT_TEXT)
    assert b"chat_template" in archive.read("tokenizer_config.json")


def test_kv_events_report_stored_blocks_and_flush_clears(scheduler, vllm, prompt_ids) -> None:
    batches: list[common_pb2.KvEventBatch] = []
    subscription = vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)
    kv_events = scheduler.public.vllm.kv_events
    wait_until(lambda: kv_events.num_subscribers == 1, timeout=10, what="the subscription")

    def read() -> None:
        try:
            batches.extend(subscription)
        except grpc.RpcError as error:  # the test cancels the call once it has what it needs
            assert error.code() == grpc.StatusCode.CANCELLED

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    fresh = [(t * 7 + 3) % 500 for t in range(2 * BLOCK_SIZE + 1)]  # a prompt no test sent before
    list(vllm.Generate(generate_request(fresh, temperature=0, max_tokens=2, ignore_eos=True), timeout=60))
    flushed = vllm.FlushCache(common_pb2.FlushCacheRequest(), timeout=10)
    assert flushed.success

    def events() -> list[common_pb2.KvCacheEvent]:
        return [e for b in list(batches) for e in b.events]

    wait_until(lambda: any(e.HasField("cleared") for e in events()), timeout=10, what="the cleared event")
    subscription.cancel()
    reader.join(timeout=10)
    stored = [b for e in events() if e.HasField("stored") for b in e.stored.blocks]
    first_hash = chain_hash(NO_PARENT_HASH, fresh[:BLOCK_SIZE])
    second_hash = chain_hash(first_hash, fresh[BLOCK_SIZE:2 * BLOCK_SIZE])
    by_hash = {b.block_hash: list(b.token_ids) for b in stored}
    assert by_hash[signed_hash(first_hash)] == fresh[:BLOCK_SIZE]
    assert by_hash[signed_hash(second_hash)] == fresh[BLOCK_SIZE:2 * BLOCK_SIZE]
    numbers = [b.sequence_number for b in list(batches)]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    wait_until(lambda: kv_events.num_subscribers == 0, timeout=10, what="the subscription to end")


# The scripted engine: what is refused before any engine call.

@pytest.fixture(scope="module")
def fake_server(tmp_path_factory: pytest.TempPathFactory):
    tokenizer = load_tokenizer(str(save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))))
    server = ServerThread(FakeEngine(tokenizer)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fake_vllm(fake_server: ServerThread):
    with grpc.insecure_channel(fake_server.target) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel), channel


def refusal(stub: vllm_engine_pb2_grpc.VllmEngineStub, request: vllm_engine_pb2.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(request, timeout=10))
    return error.value


@pytest.mark.parametrize(("sampling", "field"), [
    ({"json_schema": "{not json"}, "sampling_params.json_schema: not valid JSON"),
    ({"json_schema": "[1]"}, "sampling_params.json_schema: must be a JSON object (a schema)"),
    ({"regex": ""}, "sampling_params.regex: must not be empty"),
    ({"grammar": "x" * 70000}, "sampling_params.grammar: at most 65536 bytes"),
    ({"structural_tag": "{}"}, "sampling_params.structural_tag: structural tags are not supported"),
    ({"choice": vllm_engine_pb2.ChoiceConstraint(choices=[])}, "sampling_params.choice.choices: must list"),
    ({"n": 33}, "sampling_params.n: must be in [1, 32]"),
    ({"min_tokens": 9, "max_tokens": 4}, "sampling_params.min_tokens: must be at most max_tokens (4)"),
    ({"logit_bias": {99: 1.0}}, "sampling_params.logit_bias: token id 99"),
    ({"logit_bias": {6: 101.0}}, "sampling_params.logit_bias: biases must be in [-100, 100]"),
    ({"prompt_logprobs": 21}, "sampling_params.prompt_logprobs: must be in [0, 20]"),
    ({"prompt_logprobs": -1}, "sampling_params.prompt_logprobs: must be in [0, 20], got -1"),
    ({"logprobs": -1}, "sampling_params.logprobs: must be in [0, 20], got -1"),
    ({"truncate_prompt_tokens": 4}, "sampling_params.truncate_prompt_tokens"),
    ({"temperature": -1.0}, "sampling_params.temperature: must be >= 0"),
    ({"top_p": 1.5}, "sampling_params.top_p: must be in (0, 1]"),
    ({"max_tokens": 0}, "sampling_params.max_tokens: must be >= 1"),
    ({"max_tokens": 1000}, "sampling_params.max_tokens: 1000 + 2 prompt tokens exceed max_model_len 32"),
    ({"logprobs": 50}, "sampling_params.logprobs: must be in [0, 20]"),
    ({"seed": -1}, "sampling_params.seed: must be in [0, 2^63)"),
    ({"stop_token_ids": [99]}, "sampling_params.stop_token_ids: token id 99"),
    ({"stop": [""]}, "sampling_params.stop: each stop string"),
])
def test_unsupported_and_bad_sampling_fields_are_refused_by_name(fake_vllm, sampling, field) -> None:
    error = refusal(fake_vllm[0], generate_request([6, 7], **sampling))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(field), error.details()


@pytest.mark.parametrize(("request_fields", "field"), [
    ({"mm_inputs": vllm_engine_pb2.MultimodalInputs()}, "mm_inputs"),
    ({"extra_mm_inputs": [vllm_engine_pb2.MultimodalInputs()]}, "extra_mm_inputs"),
    ({"media_refs": vllm_engine_pb2.MediaRefs()}, "media_refs"),
    ({"kv_transfer_params": vllm_engine_pb2.KvTransferParams()}, "kv_transfer_params"),
    ({"kv_transfer_params_json": "{}"}, "kv_transfer_params_json"),
    ({"data_parallel_rank": 0}, "data_parallel_rank"),
])
def test_multimodal_and_disaggregation_fields_are_refused_by_name(fake_vllm, request_fields, field) -> None:
    request = generate_request([6, 7])
    for name, value in request_fields.items():
        if isinstance(value, list):
            getattr(request, name).extend(value)
        elif hasattr(value, "DESCRIPTOR"):
            getattr(request, name).CopyFrom(value)
        else:
            setattr(request, name, value)
    error = refusal(fake_vllm[0], request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith(f"{field}:")


def test_bad_prompts_are_refused_by_name(fake_vllm) -> None:
    stub = fake_vllm[0]
    for request, field in [(generate_request([]), "tokenized.input_ids: must not be empty"),
                           (generate_request([6, 20]), "tokenized.input_ids: token id 20 at index 1"),
                           (generate_request(list(range(6, 14)) * 4), "prompt: 32 tokens, the limit is 31"),
                           (vllm_engine_pb2.GenerateRequest(), "input: set one of tokenized or text")]:
        error = refusal(stub, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith(field)


def test_health_and_reflection_name_the_service(fake_vllm) -> None:
    stub, channel = fake_vllm
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert SERVICE_NAME in names
    (response,) = list(stub.Generate(generate_request([6, 7], temperature=0), timeout=10))
    assert list(response.complete.output_ids) == [6, 7, 1] and response.complete.matched_token_id == 1


def test_api_keys_apply(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(save_tiny_tokenizer(tmp_path / "tokenizer")))
    server = ServerThread(FakeEngine(tokenizer), api_keys=ApiKeys(None, KEY)).start()
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            for call in (lambda **kw: list(stub.Generate(generate_request([6, 7]), timeout=10, **kw)),
                         lambda **kw: stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=10, **kw)):
                with pytest.raises(grpc.RpcError) as error:
                    call()
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
                call(metadata=(("authorization", f"Bearer {KEY}"),))
    finally:
        server.stop()


def test_draining_shows_in_health_check_and_server_info(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(save_tiny_tokenizer(tmp_path / "tokenizer")))
    server = ServerThread(FakeEngine(tokenizer)).start()
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            assert stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=10).healthy
            server.run(server.public.set_not_serving())
            health = stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=10)
            assert not health.healthy and "draining" in health.message
            assert stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=10).is_paused
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                               timeout=10)
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop()


def test_mtls_applies(tmp_path: Path) -> None:
    ca, client_ca = CertificateAuthority("test CA"), CertificateAuthority("test client CA")
    server_pem, client_pem = ca.issue("localhost", server=True), client_ca.issue("gateway", server=False)
    for name, data in {"cert": server_pem.cert, "key": server_pem.key, "client_ca": client_ca.cert_pem}.items():
        (tmp_path / f"{name}.pem").write_bytes(data)
    config = PublicServerConfig(tls_cert=str(tmp_path / "cert.pem"), tls_key=str(tmp_path / "key.pem"),
                                tls_client_ca=str(tmp_path / "client_ca.pem"))
    tokenizer = load_tokenizer(str(save_tiny_tokenizer(tmp_path / "tokenizer")))
    server = ServerThread(FakeEngine(tokenizer), config=config).start()
    target = f"localhost:{server.public.port}"  # the name the certificate holds
    try:
        with_cert = grpc.ssl_channel_credentials(ca.cert_pem, client_pem.key, client_pem.cert)
        with grpc.secure_channel(target, with_cert) as channel:
            (response,) = list(vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(generate_request([6, 7]),
                                                                                     timeout=10))
            assert response.complete.finish_reason == "stop"
        with grpc.secure_channel(target, grpc.ssl_channel_credentials(ca.cert_pem)) as channel:
            with pytest.raises(grpc.RpcError) as error:
                vllm_engine_pb2_grpc.VllmEngineStub(channel).HealthCheck(vllm_engine_pb2.HealthCheckRequest(),
                                                                         timeout=10)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE  # no client certificate: no handshake
    finally:
        server.stop()


def test_the_sampling_fields_map_onto_ours() -> None:
    """n, min_tokens, logit_bias, prompt_logprobs and each constraint form reach our SamplingParams."""
    from common.contract.constraint import Constraint
    from common.contract.worker_description import WorkerDescription
    from scheduler_service.api.vllm.request_conversion import sampling_params

    info = WorkerDescription(model_name="m", dtype="float32", block_size=16, max_model_len=64, vocab_size=32,
                             num_kv_blocks=8, device="cpu", eos_token_ids=(1,))
    params = sampling_params(generate_request([6, 7], n=3, min_tokens=2, max_tokens=9, logit_bias={9: -5.0, 4: 2.5},
                                              prompt_logprobs=2, seed=4, regex="[ab]+"), 2, info)
    assert (params.n, params.min_tokens, params.max_tokens, params.seed) == (3, 2, 9, 4)
    assert params.logit_bias == ((4, 2.5), (9, -5.0)) and params.num_prompt_logprobs == 2
    assert params.constraint == Constraint("regex", "[ab]+")
    forms = {"json_schema": ({"json_schema": '{"type": "object"}'}, '{"type": "object"}'),
             "grammar": ({"grammar": 'start: "a"'}, 'start: "a"'),
             "json_object": ({"json_object": True}, ""),
             "choice": ({"choice": vllm_engine_pb2.ChoiceConstraint(choices=["x", "y"])}, ("x", "y"))}
    for kind, (fields, value) in forms.items():
        assert sampling_params(generate_request([6], **fields), 1, info).constraint == Constraint(kind, value)
    unset = sampling_params(generate_request([6], json_object=False), 1, info)
    assert (unset.constraint, unset.n, unset.num_prompt_logprobs, unset.logit_bias) == (None, 1, None, ())
