# One image for every kvindex process of compose.yaml (indexer, api, replica-sim).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY indexer ./indexer
COPY api ./api
COPY clients ./clients
COPY kvindex ./kvindex
RUN pip install --no-cache-dir .
ENTRYPOINT ["kvindex"]
