# The session-store binary on a slim image (docker-compose.yml builds it).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY migrations migrations
COPY benches benches
COPY examples examples
RUN cargo build --release --locked --bin session-store

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/session-store /usr/local/bin/session-store
USER nobody
ENTRYPOINT ["session-store"]
CMD ["serve", "--listen", "0.0.0.0:8080"]
