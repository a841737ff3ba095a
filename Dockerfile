# The rlfleet image: operator, orchestrator (trainer pod) and CLI. Engines run the SGLang image
# (lmsysorg/sglang) built by the same command-line builder.
FROM python:3.11-slim AS base
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORKDIR /opt/rlfleet
COPY requirements.lock ./
RUN pip install -r requirements.lock
COPY pyproject.toml README.md ./
COPY rlfleet ./rlfleet
COPY operator ./operator
COPY orchestrator ./orchestrator
COPY trainer ./trainer
COPY crds ./crds
COPY examples ./examples
RUN pip install --no-deps . && rlfleet --version
USER 65532:65532
ENTRYPOINT ["rlfleet"]
CMD ["operator"]
