// Package validate checks the Kubernetes manifests of deploy/ offline. It
// renders the kustomize base (deploy/base) and the example overlay
// (deploy/overlays/production, with the monitoring component) with
// sigs.k8s.io/kustomize/api, the library kubectl apply -k runs, and
// decodes each YAML document, rendered or as written, strictly (an unknown
// or misspelt field is an error) into its k8s.io/api type (a ServiceMonitor
// or a PrometheusRule into the part of its type deploy/ uses). The objects must agree with each
// other (selectors select the pods they mean, pods name Secrets, ConfigMaps
// and the ServiceAccount that deploy/ defines, every workload runs the one
// image the overlay names), and with what the docs promise (GOMEMLIMIT at
// 85-95 % of the memory limit, readiness that takes three failures and
// fails within the drain, replicas that advertise the pod's IP and may
// call each other's gRPC port, the overlay's database reachable by CIDR and
// port from every pod, and a PrometheusRule with the alerts
// docs/operations.md names, on metrics it lists).
//
// It is a module of its own so that k8s.io/api and kustomize stay out of
// the requirements of github.com/idemreg/idemreg. The checks of the
// manifests against the binary's flags live beside the binary, in
// cmd/idemreg.
package validate
