"""One frozen, validated configuration per service, plus the values learned at run time."""
from __future__ import annotations

from dataclasses import dataclass, field, fields


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler batches work. max_model_len 0 means: the worker's limit."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 0
    enable_prefix_caching: bool = True
    max_queue_size: int = 4096
    # Decode iterations per step when only decodes run: the per-step host work (scheduling, the
    # Step message, input building) is paid once per this many tokens; streams get that many
    # tokens per delta. 1 turns it off.
    num_decode_steps: int = 4
    # A lost worker's requests wait this long for a worker to answer again (then UNAVAILABLE).
    worker_timeout_s: float = 60.0
    # Every Step's deadline: the base plus this much per token it computes (and per token of the
    # step ahead of it, which it waits for). Generous: a slow CPU worker must never hit it.
    step_timeout_base_s: float = 60.0
    step_timeout_per_token_s: float = 0.05

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_model_len >= 0, "max_model_len", f"must be >= 0, got {self.max_model_len}")
        _require(self.max_queue_size >= 1, "max_queue_size", f"must be >= 1, got {self.max_queue_size}")
        _require(1 <= self.num_decode_steps <= 64, "num_decode_steps",
                 f"must be in [1, 64], got {self.num_decode_steps}")
        _require(self.worker_timeout_s > 0, "worker_timeout", f"must be > 0, got {self.worker_timeout_s}")
        _require(self.step_timeout_base_s > 0 and self.step_timeout_per_token_s >= 0, "step_timeout",
                 f"must be positive, got {self.step_timeout_base_s} + {self.step_timeout_per_token_s} per token")


@dataclass(frozen=True)
class PublicServerConfig:
    """The scheduler's public port: address, TLS, API keys, reflection and admission limits.

    TLS files are re-read when they change (new connections see the new certificate); so is the
    API key file (one key per line). Keys may also come from the NANOVLLM_API_KEYS environment
    variable (comma-separated), never from a command-line value, which `ps` would show.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    tls_cert: str | None = None  # PEM certificate chain
    tls_key: str | None = None  # PEM private key
    tls_client_ca: str | None = None  # PEM CA bundle: clients must present a certificate it signed (mTLS)
    api_key_file: str | None = None
    reflection: bool = True  # with API keys configured, reflection needs a key like every other method
    # Calls handled at once (health excepted); beyond it, RESOURCE_EXHAUSTED names this limit.
    max_concurrent_calls: int = 16384

    def __post_init__(self) -> None:
        _require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        _require((self.tls_cert is None) == (self.tls_key is None), "tls_cert",
                 "--tls-cert and --tls-key go together")
        _require(self.tls_client_ca is None or self.tls_cert is not None, "tls_client_ca",
                 "needs --tls-cert and --tls-key")
        _require(self.max_concurrent_calls >= 1, "max_concurrent_calls",
                 f"must be >= 1, got {self.max_concurrent_calls}")


@dataclass(frozen=True)
class ObservabilityConfig:
    """How a service reports on itself: the Prometheus port (0: off) and the log line format."""

    metrics_port: int = 0
    log_format: str = "text"  # "text" for people, "json" (one object per line) for log pipelines

    def __post_init__(self) -> None:
        _require(0 <= self.metrics_port <= 65535, "metrics_port", f"must be in [0, 65535], got {self.metrics_port}")
        _require(self.log_format in ("text", "json"), "log_format", f"must be text or json, got {self.log_format!r}")


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker loads and how much memory its KV cache may take."""

    model: str
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    device: str = "auto"  # auto: cuda if available, else cpu
    block_size: int = 256
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    # KV memory budget on CPU, where there is no device memory to measure.
    cpu_kv_cache_bytes: int = 1 << 30
    # Overrides the number of KV blocks derived from the memory budget (tests, debugging).
    num_kv_blocks: int = 0
    enforce_eager: bool = False
    attention_backend: str = "auto"
    # auto: the model dtype; fp8: float8_e4m3fn with one scale per token and KV head
    # (worker_service/attention/kv_quant.py), about half the bytes per token of bf16.
    kv_cache_dtype: str = "auto"
    seed: int = 0
    # The largest step the worker must serve: sizes its activation memory and its CUDA graphs.
    # The scheduler never schedules more (it takes the smaller of its own limits and these).
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    # Ranks (processes) that share the model: the first N visible GPUs, or N CPU processes.
    tensor_parallel_size: int = 1
    # GGUF on the CPU: "int4" keeps 4-bit projections quantized (torch's int4 kernels, bfloat16
    # activations), "float32" dequantizes all weights (token-exact with transformers); auto: int4 there.
    cpu_weight_format: str = "auto"

    def __post_init__(self) -> None:
        _require(bool(self.model), "model", "must name a checkpoint folder or GGUF file")
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
                 f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _require(self.kv_cache_dtype in ("auto", "fp8"), "kv_cache_dtype",
                 f"must be auto or fp8, got {self.kv_cache_dtype!r}")
        _require(self.block_size >= 16 and self.block_size & (self.block_size - 1) == 0, "block_size",
                 f"must be a power of two >= 16, got {self.block_size}")
        _require(self.max_model_len >= 1, "max_model_len", f"must be >= 1, got {self.max_model_len}")
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.cpu_kv_cache_bytes > 0, "cpu_kv_cache_bytes", f"must be > 0, got {self.cpu_kv_cache_bytes}")
        _require(self.num_kv_blocks >= 0, "num_kv_blocks", f"must be >= 0, got {self.num_kv_blocks}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size",
                 f"must be >= 1, got {self.tensor_parallel_size}")
        _require(self.tensor_parallel_size == 1 or ":" not in self.device, "device",
                 f"{self.device} names one GPU; tensor parallelism takes the first tensor_parallel_size "
                 "visible GPUs (choose them with CUDA_VISIBLE_DEVICES)")

        _require(self.cpu_weight_format in ("auto", "float32", "int4"), "cpu_weight_format",
                 f"must be auto, float32 or int4, got {self.cpu_weight_format!r}")


@dataclass(frozen=True)
class WorkerLinkConfig:
    """One end of the scheduler-worker link: the shared secret (kept out of repr, so never logged)
    and, for TLS, this end's certificate and key and the CA that signs the other end's. On the
    worker, tls_ca set means mutual TLS (client certificates required); on the scheduler, it is the
    CA the worker's certificate is checked against."""

    secret: str = field(repr=False)
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # Scheduler end only: the first claim replaces a session that holds the worker.
    takeover: bool = False

    def __post_init__(self) -> None:
        _require(bool(self.secret), "worker_secret", "must not be empty")
        _require(bool(self.tls_cert) == bool(self.tls_key), "tls_cert and tls_key", "give both or neither")

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_cert or self.tls_ca)


@dataclass(frozen=True)
class WorkerInfo:
    """What the scheduler learns from a worker at run time (its Describe reply)."""

    model_name: str
    dtype: str
    block_size: int
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    device: str
    max_num_seqs: int = 0  # 0: the worker sets no limit of its own
    max_num_batched_tokens: int = 0


def split_options(options: dict[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    """Splits keyword options between SchedulerConfig and WorkerConfig; unknown names raise."""
    scheduler_names = {f.name for f in fields(SchedulerConfig)}
    worker_names = {f.name for f in fields(WorkerConfig)}
    unknown = sorted(set(options) - scheduler_names - worker_names)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown option (known: {sorted(scheduler_names | worker_names)})")
    return ({k: v for k, v in options.items() if k in scheduler_names},
            {k: v for k, v in options.items() if k in worker_names})
