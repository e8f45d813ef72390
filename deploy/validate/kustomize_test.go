package validate

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/api/types"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

var serviceMonitorKind = schema.GroupVersionKind{Group: "monitoring.coreos.com", Version: "v1", Kind: "ServiceMonitor"}

// serviceMonitor is the part of the Prometheus Operator's ServiceMonitor
// (monitoring.coreos.com/v1) that deploy/ uses. Decoded strictly, a field
// outside it fails the test: add the field here, from the Operator's API
// reference, when deploy/ starts to use it. (The Operator's Go module is
// not a requirement: it would bring its own Kubernetes client.)
type serviceMonitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Selector          metav1.LabelSelector `json:"selector"`
		NamespaceSelector *struct {
			MatchNames []string `json:"matchNames,omitempty"`
			Any        bool     `json:"any,omitempty"`
		} `json:"namespaceSelector,omitempty"`
		Endpoints []struct {
			Port          string `json:"port"`
			Path          string `json:"path,omitempty"`
			Scheme        string `json:"scheme,omitempty"`
			Interval      string `json:"interval,omitempty"`
			ScrapeTimeout string `json:"scrapeTimeout,omitempty"`
		} `json:"endpoints"`
	} `json:"spec"`
}

// DeepCopyObject makes serviceMonitor a runtime.Object. A shallow copy:
// the tests only read it.
func (s *serviceMonitor) DeepCopyObject() runtime.Object { c := *s; return &c }

// render runs kustomize (the library kubectl apply -k runs) on dir, a
// directory of deploy/, and decodes what it renders strictly.
func render(t *testing.T, dir string) []object {
	t.Helper()
	resources, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
	require.NoError(t, err, "kustomize build %s", dir)
	raw, err := resources.AsYaml()
	require.NoError(t, err)
	return decodeManifests(t, "kustomize build "+dir, raw)
}

func keys(objs []object) []string {
	var out []string
	for _, o := range objs {
		out = append(out, o.gvk.Kind+"/"+o.meta.GetName())
	}
	slices.Sort(out)
	return out
}

// TestKustomizeBase renders the base, deploy/base/kustomization.yaml, and
// checks that it is every manifest of deploy/base but the example Secrets (so
// a file added to deploy/base and not to the kustomization fails here), and
// that the manifests name the image by the bare name the overlays'
// images: rewrite.
func TestKustomizeBase(t *testing.T) {
	base := render(t, "../base")
	var files []object
	for _, o := range readManifests(t) {
		if o.gvk.Kind != "Secret" {
			files = append(files, o)
		}
	}
	require.Equal(t, keys(files), keys(base), "deploy/base/kustomization.yaml lists every manifest of deploy/base but secrets.example.yaml")
	for _, w := range workloads(base) {
		for _, c := range w.pod.Spec.Containers {
			require.Equal(t, "idemreg", c.Image, "%s: the base names the image idemreg, for images: to rewrite", w.where)
		}
	}
}

// overlay is the images: entry and namespace of an overlay's
// kustomization.yaml, as written.
func overlay(t *testing.T, dir string) types.Kustomization {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	require.NoError(t, err)
	var k types.Kustomization
	require.NoError(t, yaml.UnmarshalStrict(raw, &k))
	return k
}

// TestProductionOverlay renders the example overlay and validates the
// result as deploy/'s own manifests are: every document strict against
// its type, the objects agreeing with each other and with the Secrets of
// secrets.example.yaml (which the cluster provides), every workload on the
// one image the overlay names (a registry and a tag or digest, never
// latest), everything in the overlay's namespace, and the ServiceMonitor
// scraping the metrics port of the Service's pods, a port the
// NetworkPolicy admits from the monitoring namespace.
func TestProductionOverlay(t *testing.T) {
	const dir = "../overlays/production"
	objs := render(t, dir)
	k := overlay(t, dir)
	require.Len(t, k.Images, 1, "the image is named once")
	img := k.Images[0]
	require.Equal(t, "idemreg", img.Name)
	require.Contains(t, img.NewName, "/", "a registry's image")
	want := img.NewName + ":" + img.NewTag
	if img.Digest != "" {
		want = img.NewName + "@" + img.Digest
	}
	require.NotEqual(t, "latest", img.NewTag)

	secrets := readManifestsIn(t, "../base/secrets.example.yaml")
	checkAgree(t, append(slices.Clone(objs), secrets...))
	for _, w := range workloads(objs) {
		for _, c := range w.pod.Spec.Containers {
			require.Equal(t, want, c.Image, "%s: the overlay's image", w.where)
		}
	}
	for _, o := range objs {
		require.Equal(t, k.Namespace, o.meta.GetNamespace(), "%s/%s in the overlay's namespace", o.gvk.Kind, o.meta.GetName())
	}

	// The migrate step of docs/operations.md applies this selection first:
	// the Job and what its pod needs, not serve or the sweeper.
	migrateFirst, err := labels.Parse("app.kubernetes.io/component notin (server,sweeper)")
	require.NoError(t, err)
	var first []string
	for _, o := range objs {
		if migrateFirst.Matches(labels.Set(o.meta.GetLabels())) {
			first = append(first, o.gvk.Kind+"/"+o.meta.GetName())
		}
	}
	require.ElementsMatch(t, []string{"ServiceAccount/idemreg", "ConfigMap/idemreg-policy", "NetworkPolicy/idemreg-baseline", "NetworkPolicy/idemreg-database", "Job/idemreg-migrate"}, first)

	var monitors []*serviceMonitor
	for _, o := range objs {
		if sm, ok := o.obj.(*serviceMonitor); ok {
			monitors = append(monitors, sm)
		}
	}
	require.Len(t, monitors, 1, "the monitoring component's ServiceMonitor")
	sm := monitors[0]
	svc := named[*corev1.Service](objs)["idemreg"]
	require.NotNil(t, svc)
	sel, err := metav1.LabelSelectorAsSelector(&sm.Spec.Selector)
	require.NoError(t, err)
	require.False(t, sel.Empty())
	require.True(t, sel.Matches(labels.Set(svc.Labels)), "the ServiceMonitor selects the Service idemreg")
	require.Nil(t, sm.Spec.NamespaceSelector, "the ServiceMonitor's own namespace, the Service's")
	require.Len(t, sm.Spec.Endpoints, 1)
	ep := sm.Spec.Endpoints[0]
	// The headless Service carries the same labels; the Operator keeps
	// only the endpoints of the named port, which it must not have, or
	// every pod would be scraped twice.
	for name, other := range named[*corev1.Service](objs) {
		if name != "idemreg" && sel.Matches(labels.Set(other.Labels)) {
			for _, p := range other.Spec.Ports {
				require.NotEqual(t, ep.Port, p.Name, "Service %s is selected too and has the port: each pod scraped twice", name)
			}
		}
	}
	var svcPort *corev1.ServicePort
	for i, p := range svc.Spec.Ports {
		if p.Name == ep.Port {
			svcPort = &svc.Spec.Ports[i]
		}
	}
	require.NotNil(t, svcPort, "the endpoint's port %q is a port of the Service", ep.Port)
	require.Equal(t, "metrics", svcPort.TargetPort.String())
	require.Equal(t, "/metrics", ep.Path)
	interval, err := time.ParseDuration(ep.Interval)
	require.NoError(t, err)
	timeout, err := time.ParseDuration(ep.ScrapeTimeout)
	require.NoError(t, err)
	require.Less(t, timeout, interval, "Prometheus refuses a scrape timeout over the interval")
	admitted := false
	for _, np := range named[*networkingv1.NetworkPolicy](objs) {
		for _, rule := range np.Spec.Ingress {
			for _, p := range rule.Ports {
				admitted = admitted || p.Port.String() == "metrics"
			}
		}
	}
	require.True(t, admitted, "a NetworkPolicy admits Prometheus to the metrics port")
}

// goMemLimit parses GOMEMLIMIT as the Go runtime does (a number of bytes
// with an optional B, KiB, MiB, GiB or TiB suffix).
func goMemLimit(t *testing.T, s string) int64 {
	t.Helper()
	m := regexp.MustCompile(`^([0-9]+)(B|KiB|MiB|GiB|TiB)?$`).FindStringSubmatch(s)
	require.NotNil(t, m, "GOMEMLIMIT=%q: a number with B, KiB, MiB, GiB or TiB", s)
	q := resource.MustParse(m[1] + strings.TrimSuffix(strings.TrimSuffix(m[2], "B"), "i") + map[bool]string{true: "i", false: ""}[len(m[2]) == 3])
	return q.Value()
}

func TestGoMemLimit(t *testing.T) {
	require.EqualValues(t, 460<<20, goMemLimit(t, "460MiB"))
	require.EqualValues(t, 1<<30, goMemLimit(t, "1GiB"))
	require.EqualValues(t, 1000, goMemLimit(t, "1000"))
	require.EqualValues(t, 1000, goMemLimit(t, "1000B"))
	require.EqualValues(t, 3<<10, goMemLimit(t, "3KiB"))
}

// TestMemoryAndReadiness checks every container of every rendering that
// deploys (the base, the production overlay with its patch, the embedded
// Deployment) for the two settings that are easy to break in an overlay:
// GOMEMLIMIT set to between 85 and 95 % of the container's memory limit
// (below it, so the collector and serve's memory guard act before the
// OOM killer; not far below, or the memory is wasted; deploy/base/idemreg.yaml
// says why 90 %), and readiness that tolerates a blip (failureThreshold of
// 3 or more) and still fails within --drain-delay, so a draining replica
// leaves the Service before it stops serving.
func TestMemoryAndReadiness(t *testing.T) {
	for name, objs := range map[string][]object{
		"deploy/base/":                render(t, "../base"),
		"deploy/overlays/production/": render(t, "../overlays/production"),
		"deploy/embedded/":            readManifestsIn(t, "../embedded/*.yaml"),
	} {
		ws := workloads(objs)
		require.NotEmpty(t, ws, name)
		for _, w := range ws {
			for _, c := range w.pod.Spec.Containers {
				limit, ok := c.Resources.Limits[corev1.ResourceMemory]
				require.True(t, ok, "%s %s: a memory limit", name, w.where)
				i := slices.IndexFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == "GOMEMLIMIT" })
				if i < 0 {
					// sweep: one bounded pass, whose heap is its batch.
					require.Equal(t, "CronJob", w.kind, "%s %s: GOMEMLIMIT set", name, w.where)
					continue
				}
				require.Nil(t, c.Env[i].ValueFrom, "%s %s: GOMEMLIMIT a fixed fraction of the limit (a resourceFieldRef is the whole limit)", name, w.where)
				ratio := float64(goMemLimit(t, c.Env[i].Value)) / float64(limit.Value())
				require.True(t, ratio >= 0.85 && ratio <= 0.95, "%s %s: GOMEMLIMIT %s is %.0f %% of the limit %s, not 85-95 %%", name, w.where, c.Env[i].Value, 100*ratio, limit.String())
			}
		}
		for dname, d := range named[*appsv1.Deployment](objs) {
			c := d.Spec.Template.Spec.Containers[0]
			rp := c.ReadinessProbe
			require.NotNil(t, rp, "%s Deployment %s", name, dname)
			require.GreaterOrEqual(t, rp.FailureThreshold, int32(3), "%s Deployment %s: one failed probe does not empty the Service", name, dname)
			drain, err := time.ParseDuration(flagValue(c.Args, "drain-delay"))
			require.NoError(t, err, "%s Deployment %s: --drain-delay", name, dname)
			require.Less(t, time.Duration(rp.PeriodSeconds*rp.FailureThreshold)*time.Second, drain,
				"%s Deployment %s: unready before the drain ends", name, dname)
		}
	}
}
