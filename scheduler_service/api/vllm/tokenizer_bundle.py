"""The tokenizer as a zip bundle the gateway can load (vllm.grpc.engine GetTokenizer).

Built from the tokenizer this scheduler runs, not from files on disk, so that a GGUF model's
tokenizer (built from the file's metadata) travels as well as a Hugging Face folder's, and the
gateway tokenizes exactly as we would: tokenizer.json (the `tokenizers` serialization),
tokenizer_config.json (chat template, BOS and EOS tokens) and generation_config.json (the EOS ids
the engine stops on). The gateway joins the chunks, checks the SHA-256 the last chunk carries and
unzips the files into one folder (smg's crates/grpc_client/src/tokenizer_bundle.rs).
"""
from __future__ import annotations

import hashlib
import io
import json
import zipfile
from collections.abc import Iterable, Iterator
from typing import Any

CHUNK_BYTES = 64 * 1024  # as smg's own servicers send it
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # the zip's timestamps: the same tokenizer gives the same bytes


def bundle_files(tokenizer: Any, eos_token_ids: Iterable[int]) -> dict[str, str]:
    """File name -> content for the bundle."""
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    if tokenizer.bos_token is not None:
        config["bos_token"] = tokenizer.bos_token
    if tokenizer.eos_token is not None:
        config["eos_token"] = tokenizer.eos_token
    return {
        "tokenizer.json": tokenizer.backend.to_str(),
        "tokenizer_config.json": json.dumps(config, ensure_ascii=False, indent=2),
        "generation_config.json": json.dumps({"eos_token_id": sorted(eos_token_ids)}),
    }


def build_bundle(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in files.items():
            archive.writestr(zipfile.ZipInfo(name, _FIXED_TIME), content.encode(), zipfile.ZIP_DEFLATED)
    return buffer.getvalue()


def chunks(data: bytes) -> Iterator[tuple[bytes, str]]:
    """(bytes, sha256) per chunk; the SHA-256 of the whole bundle on the last chunk only."""
    digest = hashlib.sha256(data).hexdigest()
    for start in range(0, len(data), CHUNK_BYTES):
        end = start + CHUNK_BYTES
        yield data[start:end], digest if end >= len(data) else ""
