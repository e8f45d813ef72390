package validate

import (
	"maps"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

var prometheusRuleKind = schema.GroupVersionKind{Group: "monitoring.coreos.com", Version: "v1", Kind: "PrometheusRule"}

// prometheusRule is the part of the Prometheus Operator's PrometheusRule
// (monitoring.coreos.com/v1) that deploy/ uses, decoded strictly as
// serviceMonitor is.
type prometheusRule struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Groups []struct {
			Name     string `json:"name"`
			Interval string `json:"interval,omitempty"`
			Rules    []struct {
				Alert       string            `json:"alert,omitempty"`
				Record      string            `json:"record,omitempty"`
				Expr        string            `json:"expr"`
				For         string            `json:"for,omitempty"`
				Labels      map[string]string `json:"labels,omitempty"`
				Annotations map[string]string `json:"annotations,omitempty"`
			} `json:"rules"`
		} `json:"groups"`
	} `json:"spec"`
}

// DeepCopyObject makes prometheusRule a runtime.Object; shallow, as
// serviceMonitor's.
func (r *prometheusRule) DeepCopyObject() runtime.Object { c := *r; return &c }

// serverPods are the labels of serve's pods in a rendering.
func serverPods(t *testing.T, objs []object) (*appsv1.Deployment, labels.Set) {
	t.Helper()
	d := named[*appsv1.Deployment](objs)["idemreg"]
	require.NotNil(t, d, "the Deployment idemreg")
	return d, labels.Set(d.Spec.Template.Labels)
}

func selectorMatches(t *testing.T, sel *metav1.LabelSelector, pods labels.Set) bool {
	t.Helper()
	s, err := metav1.LabelSelectorAsSelector(sel)
	require.NoError(t, err)
	return !s.Empty() && s.Matches(pods)
}

// TestReplicasReachEachOther checks, in the base and the production
// overlay, what waits across replicas need (docs/operations.md, "Replicas:
// membership and waits across replicas"): serve advertises the pod's IP
// from the downward API on the port it listens on, the gRPC container
// port; and the NetworkPolicies admit a replica's Wake call to another
// replica's gRPC port both ways, as ingress of the callee and egress of
// the caller (a pod of this namespace, selected by serve's pods' labels).
func TestReplicasReachEachOther(t *testing.T) {
	for _, dir := range []string{"../base", "../overlays/production"} {
		objs := render(t, dir)
		d, pods := serverPods(t, objs)
		c := d.Spec.Template.Spec.Containers[0]
		var grpcPort int32
		for _, p := range c.Ports {
			if p.Name == "grpc" {
				grpcPort = p.ContainerPort
			}
		}
		require.NotZero(t, grpcPort, "%s: a container port named grpc", dir)
		_, listenPort, err := net.SplitHostPort(flagValue(c.Args, "listen"))
		require.NoError(t, err, "%s: --listen", dir)
		require.Equal(t, strconv.Itoa(int(grpcPort)), listenPort, "%s: --listen on the grpc port", dir)
		require.Equal(t, "$(POD_IP):"+listenPort, flagValue(c.Args, "advertise-address"),
			"%s: --advertise-address is the pod's IP and the gRPC port: the pod's host name resolves nowhere else", dir)
		i := slices.IndexFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == "POD_IP" })
		require.GreaterOrEqual(t, i, 0, "%s: POD_IP in the environment, before the args that expand it", dir)
		require.NotNil(t, c.Env[i].ValueFrom, dir)
		require.NotNil(t, c.Env[i].ValueFrom.FieldRef, dir)
		require.Equal(t, "status.podIP", c.Env[i].ValueFrom.FieldRef.FieldPath, "%s: POD_IP from the downward API", dir)

		grpcAt := func(ports []networkingv1.NetworkPolicyPort) bool {
			return slices.ContainsFunc(ports, func(p networkingv1.NetworkPolicyPort) bool {
				return p.Port != nil && (p.Port.String() == "grpc" || p.Port.String() == listenPort)
			})
		}
		fromReplicas, toReplicas := false, false
		for _, np := range named[*networkingv1.NetworkPolicy](objs) {
			if !selectorMatches(t, &np.Spec.PodSelector, pods) {
				continue
			}
			for _, rule := range np.Spec.Ingress {
				for _, peer := range rule.From {
					if peer.NamespaceSelector == nil && peer.IPBlock == nil && selectorMatches(t, peer.PodSelector, pods) && grpcAt(rule.Ports) {
						fromReplicas = true
					}
				}
			}
			if !slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeEgress) {
				continue
			}
			for _, rule := range np.Spec.Egress {
				for _, peer := range rule.To {
					if peer.NamespaceSelector == nil && peer.IPBlock == nil && selectorMatches(t, peer.PodSelector, pods) && grpcAt(rule.Ports) {
						toReplicas = true
					}
				}
			}
		}
		require.True(t, fromReplicas, "%s: a NetworkPolicy admits the replicas to each other's gRPC port (ingress)", dir)
		require.True(t, toReplicas, "%s: a NetworkPolicy lets a replica call the others' gRPC port (egress)", dir)
	}
}

// TestDatabaseOutsideTheCluster renders the production overlay, whose
// database is a PostgreSQL outside the cluster by CIDR and port, and
// checks that every workload (serve, migrate, sweep) may open connections
// to that CIDR and port, and that the base's in-cluster CockroachDB rule is
// gone rather than merged beside it.
func TestDatabaseOutsideTheCluster(t *testing.T) {
	objs := render(t, "../overlays/production")
	ws := workloads(objs)
	require.Len(t, ws, 3)
	for _, w := range ws {
		pods := labels.Set(w.pod.Labels)
		var reach []string
		for name, np := range named[*networkingv1.NetworkPolicy](objs) {
			if !selectorMatches(t, &np.Spec.PodSelector, pods) || !slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeEgress) {
				continue
			}
			for _, rule := range np.Spec.Egress {
				for _, peer := range rule.To {
					require.False(t, peer.PodSelector != nil && peer.PodSelector.MatchLabels["app.kubernetes.io/name"] == "cockroachdb",
						"NetworkPolicy %s: the base's CockroachDB rule is replaced, not kept", name)
					if peer.IPBlock == nil {
						continue
					}
					_, _, err := net.ParseCIDR(peer.IPBlock.CIDR)
					require.NoError(t, err, "NetworkPolicy %s: the database's CIDR", name)
					for _, p := range rule.Ports {
						require.NotNil(t, p.Port, "NetworkPolicy %s: the database's port, not every port", name)
						reach = append(reach, peer.IPBlock.CIDR+":"+p.Port.String())
					}
				}
			}
		}
		require.Equal(t, []string{"10.40.0.0/24:5432"}, reach, "%s: egress to the overlay's PostgreSQL, CIDR and port", w.where)
	}
}

// operationsDoc is docs/operations.md, and the files under
// docs/operations/ when it is split into them, as one text.
func operationsDoc(t *testing.T) string {
	t.Helper()
	var files []string
	for _, pattern := range []string{"../../docs/operations.md", "../../docs/operations/*.md"} {
		m, err := filepath.Glob(pattern)
		require.NoError(t, err)
		files = append(files, m...)
	}
	require.NotEmpty(t, files)
	var doc strings.Builder
	for _, f := range files {
		raw, err := os.ReadFile(f)
		require.NoError(t, err)
		doc.Write(raw)
		doc.WriteString("\n\n")
	}
	return doc.String()
}

// alertParagraph is the paragraph of docs/operations.md that names the
// alerts to start from.
func alertParagraph(t *testing.T, doc string) string {
	t.Helper()
	start := strings.Index(doc, "Starting points for alerts:")
	require.GreaterOrEqual(t, start, 0, "docs/operations.md: the paragraph \"Starting points for alerts\"")
	end := strings.Index(doc[start:], "\n\n")
	require.Positive(t, end)
	return doc[start : start+end]
}

var metricName = regexp.MustCompile(`\b(?:idemreg|process|go)_[a-z0-9_]+`)

// TestPrometheusRule checks the monitoring component's PrometheusRule,
// as the production overlay renders it, against docs/operations.md: every
// metric the document's alert paragraph names is read by an alert, and
// with it the parked-records and peer-wake alerts of its runbooks; every
// idemreg_ series an alert reads is one the document lists (a histogram's
// _bucket of a listed histogram); and each alert has a severity, a
// summary, a `for` Prometheus parses and balanced brackets and templates.
func TestPrometheusRule(t *testing.T) {
	doc := operationsDoc(t)

	var rules []*prometheusRule
	for _, o := range render(t, "../overlays/production") {
		if r, ok := o.obj.(*prometheusRule); ok {
			rules = append(rules, r)
		}
	}
	require.Len(t, rules, 1, "the monitoring component's PrometheusRule")
	exprs := map[string]string{}
	for _, g := range rules[0].Spec.Groups {
		require.NotEmpty(t, g.Name)
		for _, r := range g.Rules {
			require.NotEmpty(t, r.Alert, "group %s: alerts only", g.Name)
			require.NotContains(t, exprs, r.Alert, "alert %s: named once", r.Alert)
			exprs[r.Alert] = r.Expr
			require.Contains(t, []string{"critical", "warning", "info"}, r.Labels["severity"], "alert %s: a severity", r.Alert)
			require.NotEmpty(t, r.Annotations["summary"], "alert %s: a summary", r.Alert)
			require.NotEmpty(t, r.Annotations["description"], "alert %s: a description", r.Alert)
			if r.For != "" {
				_, err := time.ParseDuration(r.For) // Prometheus' units but d, w, y
				require.NoError(t, err, "alert %s: for", r.Alert)
			}
			for _, pair := range []string{"()", "[]", "{}"} {
				require.Equal(t, strings.Count(r.Expr, pair[:1]), strings.Count(r.Expr, pair[1:]), "alert %s: %s balanced in %q", r.Alert, pair, r.Expr)
			}
			for k, a := range r.Annotations {
				require.Equal(t, strings.Count(a, "{{"), strings.Count(a, "}}"), "alert %s: annotation %s: templates closed", r.Alert, k)
			}
		}
	}
	all := strings.Join(slices.Collect(maps.Values(exprs)), "\n")

	named := metricName.FindAllString(alertParagraph(t, doc), -1)
	named = append(named, "idemreg_parked_records", "idemreg_peer_wakes_total")
	require.GreaterOrEqual(t, len(named), 12, "the paragraph's metrics were found")
	for _, m := range named {
		require.Regexp(t, `\b`+m+`(_bucket)?\b`, all, "docs/operations.md names %s for an alert; no rule reads it", m)
	}
	for alert, expr := range exprs {
		for _, m := range metricName.FindAllString(expr, -1) {
			if !strings.HasPrefix(m, "idemreg_") {
				continue
			}
			base := m
			if strings.HasSuffix(m, "_bucket") {
				base = strings.TrimSuffix(m, "_bucket")
			}
			require.Contains(t, doc, "`"+base+"`", "alert %s reads %s, which docs/operations.md does not list", alert, m)
		}
	}
}
