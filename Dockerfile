# The session-store binary on a slim image (docker-compose.yml builds it).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY migrations migrations
COPY benches benches
COPY examples examples
# Cargo reads every target Cargo.toml declares, the tests' among them,
# before it builds any (.ci/run builds from these COPY lines alone).
COPY tests tests
RUN cargo build --release --locked --bin session-store

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/session-store /usr/local/bin/session-store
# The default store is session-store.db in the working directory. nobody
# cannot write to /, so the working directory is /data, owned by nobody,
# and a volume so the store outlives the container. (SQLite also keeps its
# -wal and -shm files there.) Set DATABASE_URL for PostgreSQL instead.
RUN mkdir /data && chown nobody:nogroup /data
WORKDIR /data
VOLUME /data
# Listening on 0.0.0.0 needs tokens: without them serve refuses to start
# (exit 1), since anyone who can reach the port could read and write every
# session. Mount a token document (docs/api.md) at this path, or point the
# variable at another. It wins over SESSION_STORE_TOKENS, and an empty
# value is refused, so this image takes its tokens from a file.
ENV SESSION_STORE_TOKENS_FILE=/config/tokens.json
USER nobody
ENTRYPOINT ["session-store"]
# e.g. docker run -p 8080:8080 -v "$PWD/tokens.json:/config/tokens.json:ro" -v ss-data:/data IMAGE
CMD ["serve", "--listen", "0.0.0.0:8080"]
