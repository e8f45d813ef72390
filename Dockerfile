# syntax=docker/dockerfile:1
# Multi-stage build: a static binary in a minimal, non-root image.
#
# The binary is built by `make build`, the same target developers and CI run
# (.ci/test), so the compiler flags are defined once, in the Makefile,
# version stamp included (make build VERSION=... REVISION=...: the build
# context has no .git, see .dockerignore).
#
# cgo is off (CGO_ENABLED=0, set by make build) and nothing needs it: every
# dependency has a pure-Go build. With cgo on, the binary would link libc
# (which distroless/static does not have) for three things only: the libc
# DNS resolver and user lookups of net and os/user (Go's own are used
# instead), Pebble's block cache allocated with C malloc, outside the Go
# heap and so outside GOMEMLIMIT (it is on the Go heap instead), and
# DataDog/zstd for Pebble's zstd compression (klauspost/compress instead).
#
# Cross-compiled: the build stage runs on the builder's own platform
# (--platform=$BUILDPLATFORM) and Go compiles for the target's
# (GOOS/GOARCH from TARGETOS/TARGETARCH), so a multi-platform build
# (docker buildx build --platform linux/amd64,linux/arm64 .) runs no
# emulated compiler. Only the final stage is per platform, and it only
# copies files.
#
# Cached (BuildKit): the layers go from least to most often changed. The
# go.mod and go.sum files come first and their modules are downloaded
# before any source is copied, so an edit of the source does not download
# again; the source is copied after, and .dockerignore admits only what
# the binary is built from, so editing docs/, deploy/, tests/ or a README
# changes no layer. The module and build caches are cache mounts, kept
# between builds on the builder and never in the image, so a source edit
# recompiles only the packages it touched.
#
# Base images are pinned by digest, so a re-pushed tag cannot change what is
# built; the tag beside each digest is for the reader. To move them, take
# the new digest from the registry (crane digest IMAGE:TAG) and keep the Go
# version equal to the go line of go.mod: the golang image sets
# GOTOOLCHAIN=local, so an older Go refuses to build the module.
#
# Build with the checkout's version and revision, stamped into the binary
# and its labels (make image does this):
#   docker build --build-arg VERSION=$(git describe --tags --always --dirty) \
#     --build-arg REVISION=$(git rev-parse HEAD) \
#     --build-arg REVISION_TIME=$(git log -1 --format=%cI) -t idemreg .

# golang:1.26.8, the OCI index (Debian trixie, 16 platforms) listed in
# docker-library/repo-info, repos/golang/remote/1.26.8.md at commit
# 274d39a50141ecda8745a0ebaa20760259111041 (images of 2026-09-01).
FROM --platform=$BUILDPLATFORM golang:1.26.8@sha256:9d2f36f06329b2a141b9db99ffa32765cf695ee57b813ca29e245e8670bcbfff AS build
WORKDIR /src
COPY go.mod go.sum ./
# The API's and the client's modules. go.mod requires them at the release's
# version, which the module proxy may not serve yet and the repository's
# go.work (not in this context) serves from the checkout: this copy of
# go.mod takes them from ./proto and ./client instead.
COPY proto/go.mod proto/go.sum proto/
COPY client/go.mod client/go.sum client/
RUN --mount=type=cache,target=/go/pkg/mod \
    go mod edit -replace=github.com/idemreg/idemreg/proto=./proto -replace=github.com/idemreg/idemreg/client=./client && \
    go mod download
COPY . .
ARG TARGETOS TARGETARCH
ARG VERSION=dev
ARG REVISION=unknown
ARG REVISION_TIME=unknown
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    GOOS=$TARGETOS GOARCH=$TARGETARCH \
    make build VERSION="$VERSION" REVISION="$REVISION" REVISION_TIME="$REVISION_TIME" && \
    mkdir -p /out/data

# distroless/static: no shell, no package manager; CA certificates and
# /etc/passwd with the nonroot user (65532) only. The digest is the one
# Renovate pinned in openmcp-project/build, Dockerfile at commit
# 015c9a1c505ab119930aeb4296c881ff1fe70917.
FROM gcr.io/distroless/static-debian12:nonroot@sha256:1b7b9f0f0e0a1d2155f531db587cc48ec26aaf97ab64364225f5bf18a054e66a
ARG VERSION=dev
ARG REVISION=unknown
# LICENSE is the Apache License 2.0 (.ci/test checks it), in SPDX.
ARG LICENSES=Apache-2.0
LABEL org.opencontainers.image.title="idemreg" \
      org.opencontainers.image.description="An idempotency-key registry as one shared gRPC service" \
      org.opencontainers.image.source="https://github.com/idemreg/idemreg" \
      org.opencontainers.image.licenses="${LICENSES}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
COPY --from=build /src/bin/idemreg /usr/local/bin/idemreg
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
