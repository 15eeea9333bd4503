# Stand-in for python:3.11-slim, from Debian bookworm's own Python 3.11. It trusts the certificate
# authorities the building machine adds (its /usr/local/share/ca-certificates, copied into ca/), so pip
# reaches PyPI through the same TLS-inspecting proxy the machine does, if it has one.
ARG BASE=modelpool-standin/debian:bookworm
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python-is-python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY ca/ /usr/local/share/ca-certificates/
RUN update-ca-certificates >/dev/null
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
CMD ["python3"]
