# tollgate: one binary with every role. Build: docker build -t tollgate .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin tollgate

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/tollgate /usr/local/bin/tollgate
# The example's keys are short and public: the image's config reads every key from the
# environment (TOLLGATE_ADMIN_KEY, TOLLGATE_ACME_KEY, TOLLGATE_GLOBEX_KEY), and tollgate
# refuses keys shorter than 24 characters on a non-loopback address.
COPY tollgate.example.toml /etc/tollgate/example.toml
RUN sed -e 's/^admin_key = .*/admin_key_env = "TOLLGATE_ADMIN_KEY"/' \
        -e 's/^api_key = "tk-acme".*/api_key_env = "TOLLGATE_ACME_KEY"/' \
        -e 's/^api_key = "tk-globex".*/api_key_env = "TOLLGATE_GLOBEX_KEY"/' \
        /etc/tollgate/example.toml > /etc/tollgate/tollgate.toml \
    && ! grep -q '"tk-' /etc/tollgate/tollgate.toml
# The working directory holds `.tollgate/` (the webhook secret key file, by default):
# mount a volume there, or set `webhooks.secret_key_env`, to keep the key.
RUN mkdir -p /var/lib/tollgate && chown nobody /var/lib/tollgate
WORKDIR /var/lib/tollgate
USER nobody
EXPOSE 8080
ENTRYPOINT ["tollgate"]
CMD ["serve", "--config", "/etc/tollgate/tollgate.toml", "--listen", "0.0.0.0:8080"]
