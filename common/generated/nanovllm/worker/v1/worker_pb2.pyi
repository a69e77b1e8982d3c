from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "num_top_logprobs", "return_logprobs", "min_tokens", "min_tokens_banned_ids", "logit_bias", "num_prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_BANNED_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    num_top_logprobs: int
    return_logprobs: bool
    min_tokens: int
    min_tokens_banned_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.ScalarMap[int, float]
    num_prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., num_top_logprobs: _Optional[int] = ..., return_logprobs: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., min_tokens_banned_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., num_prompt_logprobs: _Optional[int] = ...) -> None: ...

class TokenMask(_message.Message):
    __slots__ = ("allowed_bitmask", "allowed_ids", "forbidden_ids")
    ALLOWED_BITMASK_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_IDS_FIELD_NUMBER: _ClassVar[int]
    FORBIDDEN_IDS_FIELD_NUMBER: _ClassVar[int]
    allowed_bitmask: bytes
    allowed_ids: TokenIdList
    forbidden_ids: TokenIdList
    def __init__(self, allowed_bitmask: _Optional[bytes] = ..., allowed_ids: _Optional[_Union[TokenIdList, _Mapping]] = ..., forbidden_ids: _Optional[_Union[TokenIdList, _Mapping]] = ...) -> None: ...

class TokenIdList(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("grammar", "output_token_ids")
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    grammar: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, grammar: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GrammarTokenizer(_message.Message):
    __slots__ = ("tokenizer_json", "eos_token_ids", "vocab_size", "num_text_tokens")
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokenizer_json: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    vocab_size: int
    num_text_tokens: int
    def __init__(self, tokenizer_json: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., vocab_size: _Optional[int] = ..., num_text_tokens: _Optional[int] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "num_computed_tokens", "num_tokens", "num_prompt_tokens", "block_table", "sampling", "cached_token_ids", "token_mask", "grammar")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASK_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_tokens: int
    num_prompt_tokens: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cached_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_mask: TokenMask
    grammar: Grammar
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cached_token_ids: _Optional[_Iterable[int]] = ..., token_mask: _Optional[_Union[TokenMask, _Mapping]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class RunningSequence(_message.Message):
    __slots__ = ("seq_id", "new_block_ids", "token_ids", "token_mask")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASK_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_mask: TokenMask
    def __init__(self, seq_id: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., token_mask: _Optional[_Union[TokenMask, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "session_id", "new_sequences", "running_sequences", "released_seq_ids", "num_decode_steps")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    session_id: str
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    running_sequences: _containers.RepeatedCompositeFieldContainer[RunningSequence]
    released_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_decode_steps: int
    def __init__(self, step_id: _Optional[int] = ..., session_id: _Optional[str] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., running_sequences: _Optional[_Iterable[_Union[RunningSequence, _Mapping]]] = ..., released_seq_ids: _Optional[_Iterable[int]] = ..., num_decode_steps: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprob", "top_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, seq_id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "first_position", "tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    first_position: int
    tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    def __init__(self, seq_id: _Optional[int] = ..., first_position: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "tokens", "prompt_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    def __init__(self, step_id: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids", "session_id")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    session_id: str
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model_name", "dtype", "block_size", "max_model_len", "vocab_size", "num_kv_blocks", "device", "tensor_parallel_size", "eos_token_ids", "num_held_sequences", "max_num_seqs", "max_num_batched_tokens")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    dtype: str
    block_size: int
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    device: str
    tensor_parallel_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_held_sequences: int
    max_num_seqs: int
    max_num_batched_tokens: int
    def __init__(self, model_name: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., device: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_held_sequences: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ...) -> None: ...

class InitCacheRequest(_message.Message):
    __slots__ = ("num_kv_blocks", "session_id", "takeover", "grammar_tokenizer")
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TAKEOVER_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    session_id: str
    takeover: bool
    grammar_tokenizer: GrammarTokenizer
    def __init__(self, num_kv_blocks: _Optional[int] = ..., session_id: _Optional[str] = ..., takeover: _Optional[bool] = ..., grammar_tokenizer: _Optional[_Union[GrammarTokenizer, _Mapping]] = ...) -> None: ...

class InitCacheResponse(_message.Message):
    __slots__ = ("num_kv_blocks",)
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    def __init__(self, num_kv_blocks: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
