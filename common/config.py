"""One frozen, validated configuration per service, plus the values learned at run time."""
from __future__ import annotations

from dataclasses import dataclass, fields


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

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_model_len >= 0, "max_model_len", f"must be >= 0, got {self.max_model_len}")
        _require(self.max_queue_size >= 1, "max_queue_size", f"must be >= 1, got {self.max_queue_size}")
        _require(1 <= self.num_decode_steps <= 64, "num_decode_steps",
                 f"must be in [1, 64], got {self.num_decode_steps}")


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
    seed: int = 0
    # The largest step the worker must serve: sizes its activation memory and its CUDA graphs.
    # The scheduler never schedules more (it takes the smaller of its own limits and these).
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    # GGUF on the CPU: "int4" keeps 4-bit projections quantized (torch's int4 kernels, bfloat16
    # activations), "float32" dequantizes all weights (token-exact with transformers); auto: int4 there.
    cpu_weight_format: str = "auto"

    def __post_init__(self) -> None:
        _require(bool(self.model), "model", "must name a checkpoint folder or GGUF file")
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
                 f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
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
        _require(self.cpu_weight_format in ("auto", "float32", "int4"), "cpu_weight_format",
                 f"must be auto, float32 or int4, got {self.cpu_weight_format!r}")


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
