package main

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"maps"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/config"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/configfile"
)

type probe struct {
	GRPC struct {
		Port    int     `yaml:"port"`
		Service *string `yaml:"service"`
	} `yaml:"grpc"`
	PeriodSeconds    int `yaml:"periodSeconds"`
	FailureThreshold int `yaml:"failureThreshold"`
}

type deployment struct {
	Kind string `yaml:"kind"`
	Spec struct {
		Replicas int `yaml:"replicas"`
		Template struct {
			Metadata struct {
				Labels map[string]string `yaml:"labels"`
			} `yaml:"metadata"`
			Spec struct {
				TerminationGracePeriodSeconds int `yaml:"terminationGracePeriodSeconds"`
				Containers                    []struct {
					Args []string `yaml:"args"`
					Env  []struct {
						Name      string `yaml:"name"`
						ValueFrom struct {
							FieldRef struct {
								FieldPath string `yaml:"fieldPath"`
							} `yaml:"fieldRef"`
						} `yaml:"valueFrom"`
					} `yaml:"env"`
					Ports []struct {
						Name          string `yaml:"name"`
						ContainerPort int    `yaml:"containerPort"`
					} `yaml:"ports"`
					StartupProbe   probe `yaml:"startupProbe"`
					ReadinessProbe probe `yaml:"readinessProbe"`
					LivenessProbe  probe `yaml:"livenessProbe"`
					Resources      struct {
						Requests map[string]string `yaml:"requests"`
						Limits   map[string]string `yaml:"limits"`
					} `yaml:"resources"`
					VolumeMounts []struct {
						Name      string `yaml:"name"`
						MountPath string `yaml:"mountPath"`
					} `yaml:"volumeMounts"`
				} `yaml:"containers"`
			} `yaml:"spec"`
		} `yaml:"template"`
	} `yaml:"spec"`
}

// TestDeployServe checks the Deployment in deploy/ against the binary: its
// arguments are serve's flags and pass its validation, the probes use the
// health listener (liveness on the process, readiness on the store), the
// grace period covers the drain, and the config file it mounts is valid.
func TestDeployServe(t *testing.T) {
	d := readDeployment(t)
	require.GreaterOrEqual(t, d.Spec.Replicas, 2, "several replicas on a shared store")
	pod := d.Spec.Template.Spec
	require.Len(t, pod.Containers, 1)
	c := pod.Containers[0]
	require.Equal(t, "serve", c.Args[0])

	cfg := config.Default()
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	cfg.BindServe(fs)
	require.NoError(t, fs.Parse(c.Args[1:]), "the Deployment's arguments are flags of idemreg serve")
	cfg.DatabaseURL = "postgresql://from-the-secret/idemreg"
	require.NoError(t, cfg.Validate())
	sc := cfg.Server
	require.NotEmpty(t, cfg.TLS.ClientCAFile, "callers are identified by mTLS")

	ports := map[string]int{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	require.Equal(t, port(t, cfg.Listen), ports["grpc"])
	require.Equal(t, port(t, cfg.HealthListen), ports["health"])
	require.Equal(t, port(t, cfg.MetricsListen), ports["metrics"])
	for name, p := range map[string]probe{"startup": c.StartupProbe, "readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
		require.Equal(t, ports["health"], p.GRPC.Port, "%s probe on the plaintext health listener", name)
	}
	require.Nil(t, c.ReadinessProbe.GRPC.Service, `readiness asks for "" (the store answers)`)
	require.Equal(t, "liveness", *c.LivenessProbe.GRPC.Service)
	readinessLag := time.Duration(c.ReadinessProbe.PeriodSeconds*c.ReadinessProbe.FailureThreshold) * time.Second
	require.LessOrEqual(t, readinessLag, sc.DrainDelay, "a draining pod is unready before it stops serving")
	require.Greater(t, time.Duration(pod.TerminationGracePeriodSeconds)*time.Second, sc.DrainDelay+sc.ShutdownTimeout)
	require.NotEmpty(t, c.Resources.Requests["cpu"])
	require.NotEmpty(t, c.Resources.Limits["memory"])

	mounts := map[string]string{}
	for _, m := range c.VolumeMounts {
		mounts[m.Name] = m.MountPath
	}
	require.Equal(t, mounts["config"], filepath.Dir(cfg.PolicyFile))
	for _, f := range []string{cfg.TLS.CertFile, cfg.TLS.KeyFile, cfg.TLS.ClientCAFile} {
		require.Equal(t, mounts["tls"], filepath.Dir(f))
	}

	// The mounted config file names identities (the listen address is not
	// loopback, so serve would refuse to start without them).
	rawCM, err := os.ReadFile("../../deploy/base/policy-configmap.yaml")
	require.NoError(t, err)
	var cm struct {
		Data map[string]string `yaml:"data"`
	}
	require.NoError(t, yaml.Unmarshal(rawCM, &cm))
	// serve reads the file whole, as one config.
	file, err := configfile.Parse([]byte(cm.Data[filepath.Base(cfg.PolicyFile)]), cfg.Server.Limits.Policy())
	require.NoError(t, err)
	set := file.Access
	require.True(t, set.Enforced())
	_, limited := set.RateLimit("anything")
	require.True(t, limited)
	_, limited = set.IdentityRateLimit("orders")
	require.True(t, limited, "every identity has a rate limit of its own")
	require.Equal(t, 2*time.Hour, file.Policy.For("billing.payment-worker").MaxLeaseTotal)
}

// readDeployment reads the Deployment of deploy/base/idemreg.yaml.
func readDeployment(t *testing.T) deployment {
	t.Helper()
	for _, d := range readDocs[deployment](t, "../../deploy/base/idemreg.yaml") {
		if d.Kind == "Deployment" {
			return d
		}
	}
	t.Fatal("deploy/base/idemreg.yaml has no Deployment")
	return deployment{}
}

// readDocs decodes every YAML document of the file at path into a T.
func readDocs[T any](t *testing.T, path string) []T {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	var docs []T
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	for {
		var doc T
		err := dec.Decode(&doc)
		if errors.Is(err, io.EOF) {
			return docs
		}
		require.NoError(t, err, path)
		docs = append(docs, doc)
	}
}

// subset reports whether every label of sel is in labels.
func subset(sel, labels map[string]string) bool {
	for k, v := range sel {
		if w, ok := labels[k]; !ok || w != v {
			return false
		}
	}
	return true
}

func port(t *testing.T, addr string) int {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	require.NoError(t, err)
	n, err := strconv.Atoi(p)
	require.NoError(t, err)
	return n
}

// TestDockerfileBuildsLikeMake checks that the image's binary is the one
// `make build` (which CI runs) produces: the Dockerfile runs that target and
// copies its output, with no go build of its own. It also checks what the
// image promises: base images pinned by digest, a Go no older than go.mod's
// (the golang image sets GOTOOLCHAIN=local), the OCI labels, a numeric
// non-root user and a HEALTHCHECK.
func TestDockerfileBuildsLikeMake(t *testing.T) {
	raw, err := os.ReadFile("../../Dockerfile")
	require.NoError(t, err)
	docker := string(raw)
	raw, err = os.ReadFile("../../Makefile")
	require.NoError(t, err)
	mk := string(raw)

	recipe := regexp.MustCompile(`(?m)^build:.*\n\t(.*)$`).FindStringSubmatch(mk)
	require.NotNil(t, recipe, "the Makefile's build target")
	require.Regexp(t, `^CGO_ENABLED=0 go build `, recipe[1], "a static binary: distroless/static has no libc")
	out := regexp.MustCompile(` -o (\S+) `).FindStringSubmatch(recipe[1])
	require.NotNil(t, out, "make build names its output")

	require.NotEmpty(t, slices.IndexFunc(dockerInstructions(docker), func(in dockerInstruction) bool {
		return in.cmd == "RUN" && regexp.MustCompile(`(^| )make build( |$)`).MatchString(in.args)
	}) >= 0, "a RUN of make build")
	require.NotContains(t, docker, "go build", "one definition of the build: the Makefile's")
	workdir := regexp.MustCompile(`(?m)^WORKDIR (\S+)$`).FindStringSubmatch(docker)
	require.NotNil(t, workdir)
	require.Regexp(t, `(?m)^COPY --from=build `+regexp.QuoteMeta(workdir[1]+"/"+out[1])+` `, docker,
		"the image takes the binary make build wrote")

	froms := regexp.MustCompile(`(?m)^FROM (?:--platform=\S+ )?(\S+)`).FindAllStringSubmatch(docker, -1)
	require.Len(t, froms, 2)
	for _, f := range froms {
		require.Regexp(t, `^[^@]+:[^@]+@sha256:[0-9a-f]{64}$`, f[1], "tag for the reader, digest for the build")
	}
	raw, err = os.ReadFile("../../go.mod")
	require.NoError(t, err)
	goVersion := regexp.MustCompile(`(?m)^go (\S+)$`).FindStringSubmatch(string(raw))
	require.NotNil(t, goVersion)
	require.True(t, strings.HasPrefix(froms[0][1], "golang:"+goVersion[1]+"@"),
		"the builder's Go (%s) is go.mod's (%s)", froms[0][1], goVersion[1])

	final := docker[strings.LastIndex(docker, "\nFROM "):]
	for _, label := range []string{"title", "description", "source", "licenses", "version", "revision"} {
		require.Regexp(t, `org\.opencontainers\.image\.`+label+`="[^"]+"`, final, "label %s on the final image", label)
	}
	for _, arg := range []string{"VERSION", "REVISION"} {
		require.Regexp(t, `(?m)^ARG `+arg+`\b`, final)
		require.Contains(t, final, `="${`+arg+`}"`, "%s comes from a build argument", arg)
	}
	require.Contains(t, docker, "HEALTHCHECK")
	require.Regexp(t, `(?m)^USER 65532`, docker, "non-root, numeric so runAsNonRoot can check it")
}

// TestDeployExposure checks what deploy/ opens to whom: health and metrics
// listen on the pod's IP alone (where the kubelet's probes and Prometheus
// connect, not every interface), the NetworkPolicies admit the gRPC port
// from the client namespaces (by label) and the metrics port from the
// monitoring namespace only (never the plaintext health port, which the
// kubelet reaches from the node), and the gRPC port from the other
// replicas, serve's pods reach each other's gRPC port, the database of the
// example Secret and DNS and nothing else, and the headers anonymous peers
// can pin on both listeners fit in half the pod's memory limit.
func TestDeployExposure(t *testing.T) {
	d := readDeployment(t)
	c := d.Spec.Template.Spec.Containers[0]
	cfg := config.Default()
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	cfg.BindServe(fs)
	require.NoError(t, fs.Parse(c.Args[1:]))
	sc := cfg.Server

	env := map[string]string{}
	for _, e := range c.Env {
		env[e.Name] = e.ValueFrom.FieldRef.FieldPath
	}
	require.Equal(t, "status.podIP", env["POD_IP"])
	for name, addr := range map[string]string{"--health-listen": cfg.HealthListen, "--metrics-listen": cfg.MetricsListen} {
		host, _, err := net.SplitHostPort(addr)
		require.NoError(t, err)
		require.Equal(t, "$(POD_IP)", host, "%s on the pod's IP, not every interface", name)
	}

	type peer struct {
		NamespaceSelector *struct {
			MatchLabels map[string]string `yaml:"matchLabels"`
		} `yaml:"namespaceSelector"`
		PodSelector *struct {
			MatchLabels map[string]string `yaml:"matchLabels"`
		} `yaml:"podSelector"`
		IPBlock *struct{} `yaml:"ipBlock"`
	}
	type policyPort struct {
		Port     string `yaml:"port"`
		Protocol string `yaml:"protocol"`
	}
	type netPolicy struct {
		APIVersion string `yaml:"apiVersion"`
		Kind       string `yaml:"kind"`
		Spec       struct {
			PodSelector struct {
				MatchLabels map[string]string `yaml:"matchLabels"`
			} `yaml:"podSelector"`
			PolicyTypes []string `yaml:"policyTypes"`
			Ingress     []struct {
				From  []peer       `yaml:"from"`
				Ports []policyPort `yaml:"ports"`
			} `yaml:"ingress"`
			Egress []struct {
				To    []peer       `yaml:"to"`
				Ports []policyPort `yaml:"ports"`
			} `yaml:"egress"`
		} `yaml:"spec"`
	}
	// Policies add up: what reaches serve's pods, and what they reach, is
	// the union of the rules of every policy that selects them.
	podLabels := d.Spec.Template.Metadata.Labels
	var policies []netPolicy
	isolated := map[string]bool{}
	alone := false
	for _, np := range readDocs[netPolicy](t, "../../deploy/base/networkpolicy.yaml") {
		require.Equal(t, "networking.k8s.io/v1", np.APIVersion)
		require.Equal(t, "NetworkPolicy", np.Kind)
		sel := np.Spec.PodSelector.MatchLabels
		require.NotEmpty(t, sel, "a policy of idemreg selects idemreg's pods only")
		if !subset(sel, podLabels) {
			continue
		}
		alone = alone || maps.Equal(sel, podLabels)
		for _, typ := range np.Spec.PolicyTypes {
			isolated[typ] = true
		}
		policies = append(policies, np)
	}
	require.True(t, alone, "a policy selects the Deployment's pods alone")
	require.True(t, isolated["Ingress"], "serve's pods take only what a policy admits")
	require.True(t, isolated["Egress"], "serve's pods reach only what a policy admits")

	containerPorts := map[string]bool{}
	for _, p := range c.Ports {
		containerPorts[p.Name] = true
	}
	admitted := map[string][]map[string]string{} // port → the namespace labels of its sources
	var egress []string                          // port/protocol
	replicas := false                            // the replicas admitted to each other
	for _, np := range policies {
		for _, rule := range np.Spec.Ingress {
			require.NotEmpty(t, rule.Ports, "a rule without ports admits every port")
			require.NotEmpty(t, rule.From, "a rule without sources admits everyone")
			for _, p := range rule.Ports {
				require.True(t, containerPorts[p.Port], "port %q is a named port of the container", p.Port)
				require.Equal(t, "TCP", p.Protocol)
				for _, f := range rule.From {
					require.Nil(t, f.IPBlock, "no address ranges")
					if f.NamespaceSelector == nil {
						// The other replicas' Wake calls, from this namespace.
						require.NotNil(t, f.PodSelector, "a source of this namespace is chosen by its pods' labels")
						require.Equal(t, podLabels, f.PodSelector.MatchLabels, "of this namespace's pods, serve's replicas alone")
						require.Equal(t, "grpc", p.Port, "replicas call each other's gRPC port")
						replicas = true
						continue
					}
					require.NotEmpty(t, f.NamespaceSelector.MatchLabels, "namespaces chosen by label, not all of them")
					admitted[p.Port] = append(admitted[p.Port], f.NamespaceSelector.MatchLabels)
				}
			}
		}
		for _, rule := range np.Spec.Egress {
			require.NotEmpty(t, rule.Ports, "a rule without ports reaches every port")
			require.NotEmpty(t, rule.To, "a rule without destinations reaches everything")
			for _, p := range rule.Ports {
				egress = append(egress, p.Port+"/"+p.Protocol)
			}
		}
	}
	require.ElementsMatch(t, []string{"grpc", "metrics"}, slices.Collect(maps.Keys(admitted)), "the health port is admitted from no pod")
	require.Equal(t, []map[string]string{{"kubernetes.io/metadata.name": "monitoring"}}, admitted["metrics"])

	// Egress: the database of the example Secret, and DNS.
	type secret struct {
		Metadata struct {
			Name string `yaml:"name"`
		} `yaml:"metadata"`
		StringData map[string]string `yaml:"stringData"`
	}
	var dbPort string
	for _, s := range readDocs[secret](t, "../../deploy/base/secrets.example.yaml") {
		if s.Metadata.Name == "idemreg-database" {
			u, err := url.Parse(s.StringData["url"])
			require.NoError(t, err)
			dbPort = u.Port()
		}
	}
	require.NotEmpty(t, dbPort, "the example database URL names its port")
	require.True(t, replicas, "the replicas reach each other's gRPC port (waits across replicas)")
	require.ElementsMatch(t, []string{"grpc/TCP", dbPort + "/TCP", "53/UDP", "53/TCP"}, egress, "serve reaches the other replicas, the database and DNS, nothing else")

	// A call whose request never comes keeps its goroutine and headers
	// until its connection closes: what both listeners can pin at worst,
	// at the measured cost of such a call (server.HeldCallBytes, at the
	// default header bound, which deploy/ must not raise).
	b := sc.Bounds
	require.LessOrEqual(t, b.MaxHeaderListSize, uint32(server.DefaultMaxHeaderListSize), "HeldCallBytes is measured at the default header bound")
	held := min(int64(b.MaxPendingCalls), 2*int64(b.MaxConnections)*int64(b.MaxConcurrentStreams))
	pinned := held * server.HeldCallBytes
	limit := c.Resources.Limits["memory"]
	require.Regexp(t, `^[0-9]+Mi$`, limit)
	mib, err := strconv.ParseInt(strings.TrimSuffix(limit, "Mi"), 10, 64)
	require.NoError(t, err)
	require.LessOrEqual(t, pinned, mib<<20/4, "held calls (%d, %d MiB) within a quarter of the memory limit (%s)", held, pinned>>20, limit)
}

// TestDeployEmbeddedServe checks deploy/embedded's Deployment against the
// binary: its arguments are serve's flags and pass its validation, the
// store is the embedded one with a reserve, and a failed store's drain
// (--drain-delay, then --shutdown-timeout) fits the grace period before
// the exit the kubelet restarts.
func TestDeployEmbeddedServe(t *testing.T) {
	docs := readDocs[deployment](t, "../../deploy/embedded/idemreg.yaml")
	var d *deployment
	for i := range docs {
		if docs[i].Kind == "Deployment" {
			d = &docs[i]
		}
	}
	require.NotNil(t, d, "deploy/embedded/idemreg.yaml has a Deployment")
	require.Equal(t, 1, d.Spec.Replicas)
	c := d.Spec.Template.Spec.Containers[0]
	cfg := config.Default()
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	cfg.BindServe(fs)
	require.NoError(t, fs.Parse(c.Args[1:]), "the Deployment's arguments are flags of idemreg serve")
	require.NoError(t, cfg.Validate())
	require.Empty(t, cfg.DatabaseURL)
	require.Positive(t, cfg.DataDirReserve)
	mounts := map[string]string{}
	for _, m := range c.VolumeMounts {
		mounts[m.Name] = m.MountPath
	}
	require.Equal(t, mounts["data"], filepath.Dir(cfg.DataDir), "--data-dir is on the data volume")
	require.Greater(t, time.Duration(d.Spec.Template.Spec.TerminationGracePeriodSeconds)*time.Second, cfg.Server.DrainDelay+cfg.Server.ShutdownTimeout)
}
