# consolidation: the API and the worker in one process. Build: docker build -t consolidation .
# The base image is pinned to an exact tag and every dependency to the versions of
# requirements.lock (regenerate it with the command at its top), so a rebuild is the same image.
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md requirements.lock ./
COPY consolidation ./consolidation
COPY migrations ./migrations
RUN pip wheel --no-cache-dir --constraint requirements.lock --wheel-dir /wheels .

FROM python:3.11.11-slim-bookworm
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
# The embedded Postgres (no CONSOLIDATION_DATABASE_URL) lives here. No VOLUME instruction: with
# an external Postgres there is nothing to keep, and an anonymous volume per container would
# pile up. For the embedded one, name a volume: docker run -v consolidation-data:/data …
# The API listens on 0.0.0.0 in the container, so `serve` refuses to start without
# CONSOLIDATION_API_KEY (or CONSOLIDATION_ALLOW_UNAUTHENTICATED=true).
EXPOSE 8080
# The service's readiness on whatever port it was given (the fake LLM overrides this check).
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('CONSOLIDATION_HTTP_PORT', '8080'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/readyz', timeout=2).status == 200 else 1)"]
# SIGTERM drains gracefully (CONSOLIDATION_SHUTDOWN_GRACE_S); give it time to.
STOPSIGNAL SIGTERM
ENTRYPOINT ["consolidation"]
CMD ["serve"]
