# Build: dependencies first (cached while only our sources change), then the crate.
FROM rust:1.89-bookworm AS build
WORKDIR /app
COPY Cargo.toml Cargo.lock ./
RUN mkdir src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && cargo build --release --locked \
    && rm -rf src target/release/.fingerprint/seckill-* target/release/deps/seckill-* target/release/deps/libseckill-*
COPY src src
COPY migrations migrations
COPY lua lua
RUN touch src/main.rs src/lib.rs && cargo build --release --locked

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 seckill \
    && mkdir -p /var/lib/seckill && chown seckill /var/lib/seckill
COPY --from=build /app/target/release/seckill /usr/local/bin/seckill
USER seckill
EXPOSE 8080
ENV BIND=0.0.0.0:8080
HEALTHCHECK --interval=5s --timeout=2s --retries=12 CMD curl -fsS http://127.0.0.1:8080/healthz || exit 1
ENTRYPOINT ["seckill"]
CMD ["serve"]
