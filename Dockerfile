# Two images from one build file; engines run the SGLang image (lmsysorg/sglang) built by the same
# command-line builder.
#
#   docker build --target operator -t rlfleet/rlfleet-operator:0.1.0 .   # the Kopf operator only
#   docker build --target trainer  -t rlfleet/rlfleet:0.1.0 .            # trainer pod, tiny-model init, CLI
#
# The operator image installs requirements-operator.lock (kopf, the Kubernetes client, pydantic,
# aiohttp, prometheus-client; no torch, SGLang, transformers or CUDA wheels); the trainer image the
# whole requirements.lock. Both pin the same versions (tests/unit/test_dependency_split.py).
FROM python:3.11-slim AS base
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /opt/rlfleet

FROM base AS source
COPY pyproject.toml README.md ./
COPY rlfleet ./rlfleet
COPY operator ./operator
COPY orchestrator ./orchestrator
COPY trainer ./trainer
COPY crds ./crds
COPY examples ./examples

FROM base AS operator
COPY requirements-operator.lock ./
RUN pip install --no-deps -r requirements-operator.lock && pip check
COPY --from=source /opt/rlfleet ./
RUN pip install --no-deps . && rlfleet operator --help >/dev/null
USER 65532:65532
ENTRYPOINT ["rlfleet"]
CMD ["operator"]

FROM base AS trainer
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
COPY requirements.lock requirements-tracking.lock ./
RUN pip install -r requirements.lock && pip install --no-deps -r requirements-tracking.lock
COPY --from=source /opt/rlfleet ./
RUN pip install --no-deps . && rlfleet --version
USER 65532:65532
ENTRYPOINT ["rlfleet"]
CMD ["--help"]
