# The developers' entry point. `make test` is the README's test command.
BUF := go tool -modfile=proto/tools/go.mod buf
# Every Go module but the buf tools' (docs/design.md, Modules); .ci/test
# vets and tests each on its own go.mod.
GO_MODULES := $(shell git ls-files -- '*go.mod' ':!proto/tools' | xargs -n1 dirname)

.PHONY: run test adversarial generate lint breaking bench build image

run: ## run the service on the embedded store
	go run ./cmd/idemreg serve

build: ## the static binary; the Dockerfile runs this target too
	CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o bin/idemreg ./cmd/idemreg

image: ## the container image, labelled with this checkout's version and revision
	docker build --build-arg VERSION=$$(git describe --tags --always --dirty) \
		--build-arg REVISION=$$(git rev-parse HEAD) -t idemreg .

test: ## the whole suite; starts PostgreSQL if it is down
	.ci/test

adversarial: ## the adversarial suite against a real serve (docs/testing.md, "Adversarial suite"); .ci/test runs it too
	cd tests && go test -count=1 -timeout 10m ./adversarial/ -v

generate: ## regenerate Go code from proto/ and examples/proto/, the reason constants from ErrorReason, and the TypeScript client's code
	$(BUF) generate --template proto/buf.gen.yaml
	cd proto/idemreg/v1 && go test -count=1 -run '^TestReasonConstants$$' . -args -update
	cd examples && go tool -modfile=../proto/tools/go.mod buf generate
	cd clients/typescript && npm ci --no-audit --no-fund
	$(BUF) generate --template clients/typescript/buf.gen.yaml

lint:
	$(BUF) lint
	cd examples && go tool -modfile=../proto/tools/go.mod buf lint
	for m in $(GO_MODULES); do (cd $$m && go vet ./...) || exit 1; done
	cd tests && go vet -tags 'linearizability chaos' ./...

breaking: ## compare the API with main (.ci/breaking says against which commit)
	.ci/breaking

bench:
	go test -run '^$$' -bench . -benchmem ./...
