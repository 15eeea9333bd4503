# Stand-in for haproxy:2.8-alpine: Debian bookworm's HAProxy 2.6.
ARG BASE=modelpool-standin/debian:bookworm
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends haproxy \
 && rm -rf /var/lib/apt/lists/*
ENTRYPOINT []
CMD ["haproxy", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
