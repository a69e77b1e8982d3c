"""GetTokenizer's bundle for a GGUF model: built from the tokenizer the scheduler makes of the file's
metadata, it loads with the `tokenizers` library and tokenizes as the scheduler does, with the chat
template and special tokens in its config; the same tokenizer always gives the same bytes."""
from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import gguf
from tokenizers import Tokenizer as BackendTokenizer

from scheduler_service.api.tokenizer import GGUF_CONTROL_TOKEN_TYPE, tokenizer_from_gguf
from scheduler_service.api.vllm import tokenizer_bundle
from tests.tiny_models import TINY_CHAT_TEMPLATE, save_tiny_bpe_tokenizer

TEXT = "The quick brown fox <|user|> says ça coûte combien?"


def write_tokenizer_gguf(folder: Path) -> Path:
    """A GGUF holding only a gpt2-style tokenizer: the tiny byte-level BPE's vocabulary and merges."""
    model = json.loads((save_tiny_bpe_tokenizer(folder / "hf") / "tokenizer.json").read_text())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    special = {"<|end|>", "<|user|>", "<|assistant|>", "<|system|>"}
    path = folder / "tokenizer-only.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([GGUF_CONTROL_TOKEN_TYPE if t in special else 1 for t in tokens])
    writer.add_eos_token_id(tokens.index("<|end|>"))
    writer.add_bos_token_id(tokens.index("<|system|>"))
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_tokenizer_travels_whole(tmp_path: Path) -> None:
    tokenizer = tokenizer_from_gguf(write_tokenizer_gguf(tmp_path))
    eos_id = tokenizer.eos_token_id
    data = tokenizer_bundle.build_bundle(tokenizer_bundle.bundle_files(tokenizer, [eos_id]))
    assert data == tokenizer_bundle.build_bundle(tokenizer_bundle.bundle_files(tokenizer, [eos_id]))
    archive = zipfile.ZipFile(io.BytesIO(data))
    backend = BackendTokenizer.from_str(archive.read("tokenizer.json").decode())
    assert backend.encode(TEXT).ids == tokenizer.encode(TEXT)
    assert backend.decode(tokenizer.encode(TEXT), skip_special_tokens=False) == TEXT
    config = json.loads(archive.read("tokenizer_config.json"))
    assert (config["chat_template"], config["eos_token"], config["bos_token"]) == (
        TINY_CHAT_TEMPLATE, "<|end|>", "<|system|>")
    assert json.loads(archive.read("generation_config.json")) == {"eos_token_id": [eos_id]}


def test_chunks_carry_the_digest_on_the_last_only() -> None:
    data = bytes(range(256)) * 600  # 150 KiB: three chunks
    chunks = list(tokenizer_bundle.chunks(data))
    assert [len(c) for c, _ in chunks] == [tokenizer_bundle.CHUNK_BYTES] * 2 + [len(data) - 2 * 65536]
    assert [d for _, d in chunks] == ["", "", hashlib.sha256(data).hexdigest()]
