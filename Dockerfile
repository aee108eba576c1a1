# One image for every kvindex process of compose.yaml (indexer, api, proxy, replica-sim).
# The first stage builds the wheel with a C compiler (the compiled core, setup.py); the image
# itself carries only the installed package, and runs as an unprivileged user.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md LICENSE ./
COPY indexer ./indexer
COPY api ./api
COPY clients ./clients
COPY kvindex ./kvindex
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
# [k8s]: the Kubernetes client of --k8s-pool / --k8s-selector (the Helm chart's discovery).
RUN pip install --no-cache-dir "$(ls /wheels/*.whl)[k8s]" && rm -rf /wheels \
    && useradd --system --uid 10001 --user-group --create-home kvindex
USER 10001:10001
WORKDIR /home/kvindex
# The process's own health route: the API's by default; compose.yaml gives each service its
# own (the indexer's status port, the proxy's port, a replica-sim's /health).
ENV HEALTHCHECK_URL=http://127.0.0.1:8000/healthz
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen(os.environ['HEALTHCHECK_URL'], timeout=2)"]
ENTRYPOINT ["kvindex"]
