# kproxy's container image. Build it from the repository root, anywhere Docker (or Podman, or
# BuildKit) runs:   docker build -t kproxy:0.1.0 .
# The image runs as a non-root user, holds no build tools, and has no HEALTHCHECK: Kubernetes probes
# the admin listener (/livez, /readyz) instead. deploy/ and helm/kproxy use it.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kproxy ./kproxy
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels
# The default configuration reads everything site-specific from the environment; the example rule
# sets are there to copy from (no rule file is loaded unless a configuration names it).
COPY deploy/image/kproxy.yaml /etc/kproxy/kproxy.yaml
COPY rules /etc/kproxy/examples/rules
# A numeric user, so Kubernetes can verify runAsNonRoot without a passwd entry.
USER 10001:10001
EXPOSE 9092 9644
ENTRYPOINT ["kproxy"]
CMD ["run", "--config", "/etc/kproxy/kproxy.yaml"]
