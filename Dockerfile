# kproxy's container image. Build it from the repository root, anywhere Docker (or Podman, or
# BuildKit) runs:   docker build -t kproxy:0.1.0 .
# The image runs as a non-root user, holds no build tools, and has no HEALTHCHECK: Kubernetes probes
# the admin listener (/livez, /readyz) instead. deploy/ and helm/kproxy use it.
# tests/release/test_image.py builds it with podman on a local Debian base and runs it as the chart does.

# The build stage compiles the codec accelerator (kproxy/protocol/_accel.c, declared in setup.py) and
# collects kproxy's wheel with every dependency's wheel in /wheels.
FROM python:3.11-slim AS build
# A C compiler, and the Python headers where the base has none (python:*-slim ships them; a base
# built from Debian's python3 needs python3-dev). They stay in this stage only.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
      $(python3 -c "import os, sysconfig; print('' if os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')) else 'python3-dev')") \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kproxy ./kproxy
# The extension is optional for pip (a user's install without a compiler still works), but not for
# the image: stop here if the wheel came out without it.
RUN python3 -m pip wheel --no-cache-dir --wheel-dir /wheels . \
 && python3 -c "import glob, sys, zipfile; names = zipfile.ZipFile(glob.glob('/wheels/kproxy_kafka-*.whl')[0]).namelist(); sys.exit(0 if any(n.startswith('kproxy/protocol/_accel.') and n.endswith('.so') for n in names) else 'the kproxy wheel has no compiled accelerator')"

FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The wheels are mounted from the build stage for this one step, so no layer keeps them.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python3 -m pip install --no-index --find-links /wheels kproxy-kafka
# The default configuration reads everything site-specific from the environment; the example rule
# sets are there to copy from (no rule file is loaded unless a configuration names it).
COPY deploy/image/kproxy.yaml /etc/kproxy/kproxy.yaml
COPY rules /etc/kproxy/examples/rules
# A numeric user, so Kubernetes can verify runAsNonRoot without a passwd entry.
USER 10001:10001
EXPOSE 9092 9644
ENTRYPOINT ["kproxy"]
CMD ["run", "--config", "/etc/kproxy/kproxy.yaml"]
