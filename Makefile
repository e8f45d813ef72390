# The developers' entry point. `make test` is the README's test command.
# buf and its plugins come from their own module (proto/tools), outside the
# workspace (go.work), hence GOWORK=off, which buf's plugins inherit;
# .ci/buf builds buf once per proto/tools/go.sum into a cache directory.
BUF := .ci/buf
# Every Go module but the buf tools' (docs/design.md, Modules); .ci/test
# vets and tests each on its own go.mod.
GO_MODULES := $(shell git ls-files -- '*go.mod' ':!proto/tools' | xargs -n1 dirname)
# The modules outside the workspace (go.work): go runs there with GOWORK=off.
STANDALONE := deploy/validate internal/release

# What `idemreg version` prints, stamped by make build (-ldflags -X). The
# Dockerfile has no .git, so it passes all three from its build arguments
# (make image sets them from this checkout).
# --match: the registry's own tags (v0.1.0), not the other modules'
# (client/v0.1.0, proto/v0.1.0, ...), which name the same commits.
VERSION ?= $(shell git describe --tags --match 'v[0-9]*' --always --dirty 2>/dev/null || echo dev)
REVISION ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
REVISION_TIME ?= $(shell git log -1 --format=%cI 2>/dev/null || echo unknown)
LDFLAGS := -s -w -X main.version=$(VERSION) -X main.revision=$(REVISION) -X main.revisionTime=$(REVISION_TIME)

.PHONY: run test adversarial generate lint tidy breaking bench build image

run: build ## build the binary that ships (make build) and serve on the embedded store
	./bin/idemreg serve

# Static (cgo off), as the image ships it: nothing needs cgo, and the
# embedded store measured no faster nor cheaper in CPU with it (README.md,
# "Quick start").
# GOOS and GOARCH from the environment cross-compile (the Dockerfile sets
# them from the target platform).
build: ## the static binary; the Dockerfile runs this target too
	CGO_ENABLED=0 go build -trimpath -ldflags='$(LDFLAGS)' -o bin/idemreg ./cmd/idemreg

image: ## the container image, labelled and stamped with this checkout's version and revision
	DOCKER_BUILDKIT=1 docker build --build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) \
		--build-arg REVISION_TIME=$(REVISION_TIME) -t idemreg .

test: ## the whole suite; starts PostgreSQL if it is down
	.ci/test

adversarial: ## the adversarial suite against a real serve (docs/testing.md, "Adversarial suite"); .ci/test runs it too
	cd tests && go test -count=1 -timeout 10m ./adversarial/ -v

generate: ## regenerate Go code from proto/ and examples/proto/, the reason constants from ErrorReason, and the TypeScript and Python clients' code
	$(BUF) generate --template proto/buf.gen.yaml
	cd proto/idemreg/v1 && go test -count=1 -run '^TestReasonConstants$$' . -args -update
	cd examples && ../.ci/buf generate
	cd clients/typescript && npm ci --no-audit --no-fund
	$(BUF) generate --template clients/typescript/buf.gen.yaml
	$(BUF) generate --template clients/python/buf.gen.yaml
	$(BUF) generate --template docs/openapi/buf.gen.yaml

lint:
	$(BUF) lint
	cd examples && ../.ci/buf lint
	for m in $(GO_MODULES); do \
		case " $(STANDALONE) " in *" $$m "*) w=off;; *) w=;; esac; \
		(cd $$m && GOWORK=$$w go vet ./...) || exit 1; \
	done
	cd tests && go vet -tags 'linearizability chaos' ./...

# go mod tidy cannot resolve our modules' own versions before they are on the
# module proxy; .ci/tidy -w tidies a module with them taken from this checkout.
tidy: ## go mod tidy in every Go module, each seen alone
	for m in $(GO_MODULES); do .ci/tidy -w $$m || exit 1; done

breaking: ## compare the API with main (.ci/breaking says against which commit)
	.ci/breaking

bench:
	go test -run '^$$' -bench . -benchmem ./...
