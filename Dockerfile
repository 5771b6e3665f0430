# consolidation: the API and the worker in one process. Build: docker build -t consolidation .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY consolidation ./consolidation
COPY migrations ./migrations
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    CONSOLIDATION_HTTP_HOST=0.0.0.0 \
    CONSOLIDATION_HTTP_PORT=8080 \
    CONSOLIDATION_LOG_FORMAT=json \
    CONSOLIDATION_DATA_DIR=/data
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && useradd --system --uid 10001 --home-dir /data --create-home consolidation
USER consolidation
WORKDIR /data
# The embedded Postgres (no CONSOLIDATION_DATABASE_URL) lives here: a volume, so `docker rm`
# does not take it along. Name it to find it again: docker run -v consolidation-data:/data …
VOLUME ["/data"]
EXPOSE 8080
# The service's readiness on whatever port it was given (the fake LLM overrides this check).
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('CONSOLIDATION_HTTP_PORT', '8080'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/readyz', timeout=2).status == 200 else 1)"]
# SIGTERM drains gracefully (CONSOLIDATION_SHUTDOWN_GRACE_S); give it time to.
STOPSIGNAL SIGTERM
ENTRYPOINT ["consolidation"]
CMD ["serve"]
