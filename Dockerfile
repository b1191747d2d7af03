# The straggler collector (otel-straggler-collector): OTLP in, straggler verdicts, Prometheus /metrics out.
#   docker build -t otel-straggler-collector:0.1.0 .
# (without --config the collector runs the configuration in the package: loopback only, of no use in a container)
#   docker run -v $PWD/configs/collector-compose.yaml:/etc/otel-straggler/collector.yaml:ro \
#     -p 127.0.0.1:4317:4317 -p 127.0.0.1:9464:9464 otel-straggler-collector:0.1.0
FROM python:3.11.13-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# README.md* : the readme pyproject.toml names, copied when present (a glob may match nothing).
COPY pyproject.toml setup.py MANIFEST.in LICENSE CHANGELOG.md README.md* ./
# every package of the distribution: the emitter, the contract (the collector imports it), the collector, the demo
COPY otel_straggler ./otel_straggler
COPY otel_straggler_schema ./otel_straggler_schema
COPY collector_processor ./collector_processor
COPY otel_straggler_demo ./otel_straggler_demo
# the built-in configuration (collector_processor/config/collector.yaml links to it)
COPY configs/collector.yaml ./configs/collector.yaml
RUN pip install '.[collector]' && rm -rf /src/build

RUN useradd --system --uid 10001 --home-dir /var/lib/otel-straggler --create-home otel \
    && mkdir -p /etc/otel-straggler && chown otel /var/lib/otel-straggler
COPY configs/collector-compose.yaml /etc/otel-straggler/collector.yaml

USER 10001
WORKDIR /var/lib/otel-straggler
# 4317 OTLP gRPC, 4318 OTLP HTTP, 9464 Prometheus /metrics
EXPOSE 4317 4318 9464
ENTRYPOINT ["otel-straggler-collector", "--config", "/etc/otel-straggler/collector.yaml"]
