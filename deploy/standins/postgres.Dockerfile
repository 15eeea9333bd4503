# Stand-in for postgres:16: Debian bookworm's PostgreSQL 15, set up from POSTGRES_USER, POSTGRES_PASSWORD and
# POSTGRES_DB on an empty data directory as the official image does.
ARG BASE=modelpool-standin/debian:bookworm
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends postgresql-15 \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["postgres-entrypoint.sh"]
CMD ["postgres"]
