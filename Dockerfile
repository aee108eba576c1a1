# One image for every kvindex process of compose.yaml (indexer, api, proxy, replica-sim).
# The first stage builds the wheel with a C compiler (the compiled core, setup.py); the image
# itself carries only the installed package.
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
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
ENTRYPOINT ["kvindex"]
