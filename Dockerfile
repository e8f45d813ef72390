# Multi-stage build: a static binary (CGO_ENABLED=0) in a minimal, non-root
# image. `make build` builds the same binary with the same flags, and CI runs
# it (.ci/test), so a Go change that breaks this build fails CI.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /out/idemreg ./cmd/idemreg && mkdir -p /out/data

# distroless/static: no shell, no package manager; CA certificates and
# /etc/passwd with the nonroot user (65532) only.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/idemreg /usr/local/bin/idemreg
COPY --from=build --chown=65532:65532 /out/data /var/lib/idemreg
# The embedded store's data directory; mount a volume here for one replica,
# or pass IDEMREG_DATABASE_URL for PostgreSQL/CockroachDB.
WORKDIR /var/lib/idemreg
USER 65532:65532
# 7350: gRPC (RegistryService, AdminService, health, reflection).
# 7351: grpc.health.v1 alone, plaintext, for probes (Kubernetes gRPC probes
#       cannot speak TLS, and this image has no other probe tool).
# 9350: Prometheus metrics at /metrics.
EXPOSE 7350 7351 9350
# Listening on every interface is not loopback, so serve refuses to start
# until it is told how callers are secured: --tls-cert/--tls-key (and
# --tls-client-ca for mTLS) and identities in --config, or, to try the image
# out, IDEMREG_PLAINTEXT=true and IDEMREG_ALLOW_UNAUTHENTICATED=true
# explicitly. deploy/ and docs/operations.md show the production setting.
ENV IDEMREG_LISTEN=0.0.0.0:7350 \
    IDEMREG_HEALTH_LISTEN=0.0.0.0:7351 \
    IDEMREG_METRICS_LISTEN=0.0.0.0:9350 \
    IDEMREG_DATA_DIR=/var/lib/idemreg
# Ready = the store answers. Kubernetes ignores HEALTHCHECK; deploy/ uses
# native gRPC probes on 7351 instead.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["/usr/local/bin/idemreg", "health", "--addr", "127.0.0.1:7351"]
ENTRYPOINT ["/usr/local/bin/idemreg"]
CMD ["serve"]
