# Multi-stage build: a static binary (CGO_ENABLED=0) in a minimal,
# non-root image. `make build` builds the same binary with the same flags.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /out/idemreg ./cmd/idemreg && mkdir -p /out/data

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/idemreg /usr/local/bin/idemreg
COPY --from=build --chown=65532:65532 /out/data /var/lib/idemreg
# The embedded store's data directory; mount a volume here for one replica,
# or pass IDEMREG_DATABASE_URL for PostgreSQL/CockroachDB.
WORKDIR /var/lib/idemreg
USER nonroot:nonroot
EXPOSE 7350
ENV IDEMREG_LISTEN=0.0.0.0:7350 IDEMREG_DATA_DIR=/var/lib/idemreg
ENTRYPOINT ["/usr/local/bin/idemreg"]
CMD ["serve"]
