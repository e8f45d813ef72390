// Package validate checks the Kubernetes manifests of deploy/ offline: each
// YAML document decodes strictly (an unknown or misspelt field is an error)
// into its k8s.io/api type, and the objects agree with each other (selectors
// select the pods they mean, pods name Secrets, ConfigMaps and the
// ServiceAccount that deploy/ defines, every workload runs the same image).
//
// It is a module of its own so that k8s.io/api stays out of the
// requirements of github.com/idemreg/idemreg. The checks of the manifests
// against the binary's flags live beside the binary, in cmd/idemreg.
package validate
