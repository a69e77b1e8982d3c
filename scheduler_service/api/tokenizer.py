"""The scheduler's tokenizer: the `tokenizers` library plus the model's Jinja chat template,
loaded from a Hugging Face folder or from GGUF metadata. transformers is not used here because
importing its tokenizers pulls in torch, which the scheduler service never imports."""
from __future__ import annotations

import functools
import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from common.formats.checkpoint import find_gguf_file
from common.formats.gguf_file import GGUFFile

logger = logging.getLogger(__name__)
GGUF_CONTROL_TOKEN_TYPE = 3


class Tokenizer:
    """The subset of a Hugging Face tokenizer that the services use."""

    def __init__(self, backend: BackendTokenizer, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def bos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.bos_token) if self.bos_token else None

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token stands for, over-estimated from the vocabulary's
        strings (byte-level and SentencePiece vocabularies spell a byte or a space with a longer
        character): how a text too long for a context is told before it is tokenized."""
        return max((len(piece.encode()) for piece in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str | list[int]:
        """Renders the conversation as Hugging Face does (trim_blocks, lstrip_blocks, sandboxed)."""
        if self.chat_template is None:
            raise ValueError("chat: this model's tokenizer has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# Loading.

def load_tokenizer(model: str) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none (a bare test checkpoint)."""
    path = Path(model)
    gguf = find_gguf_file(path)
    if gguf is not None:
        return tokenizer_from_gguf(gguf)
    if not (path / "tokenizer.json").exists():
        logger.warning("%s ships no tokenizer.json: only token-id prompts will be accepted", model)
        return None
    return tokenizer_from_folder(path)


def tokenizer_from_folder(folder: Path) -> Tokenizer:
    backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    template = config.get("chat_template")
    if (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return Tokenizer(backend, template, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_from_gguf(path: Path) -> Tokenizer:
    """Builds a byte-level BPE tokenizer from GGUF metadata (tokenizer.ggml.model "gpt2")."""
    metadata = GGUFFile(path).metadata
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer: GGUF tokenizer type {kind!r} is not supported (only gpt2-style BPE); "
                         f"pass --tokenizer with a Hugging Face tokenizer folder")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    backend = BackendTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type", [])
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, token_type in enumerate(types) if token_type == GGUF_CONTROL_TOKEN_TYPE])
    bos, eos = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.eos_token_id")
    return Tokenizer(backend, metadata.get("tokenizer.chat_template"), tokens[bos] if bos is not None else None,
                     tokens[eos] if eos is not None else None)


def eos_token_ids(model: str, tokenizer: Tokenizer | None) -> set[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer together."""
    ids: set[int] = set()
    path = Path(model)
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if path.is_dir() and file.exists():
            eos = json.loads(file.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
