package validate

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// scheme knows the API groups deploy/ may use; a kind outside them fails
// the test rather than going unchecked.
var scheme = func() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		corev1.AddToScheme, appsv1.AddToScheme, batchv1.AddToScheme,
		networkingv1.AddToScheme, policyv1.AddToScheme,
	} {
		if err := add(s); err != nil {
			panic(err)
		}
	}
	return s
}()

// object is one decoded document of deploy/.
type object struct {
	where string // file:document, for messages
	gvk   schema.GroupVersionKind
	obj   runtime.Object
	meta  metav1.Object
}

// readManifests decodes every YAML document of deploy/base strictly into
// its k8s.io/api type.
func readManifests(t *testing.T) []object {
	t.Helper()
	return readManifestsIn(t, "../base/*.yaml")
}

// readManifestsIn decodes the documents of the files pattern names.
func readManifestsIn(t *testing.T, pattern string) []object {
	t.Helper()
	files, err := filepath.Glob(pattern)
	require.NoError(t, err)
	require.NotEmpty(t, files)
	var out []object
	for _, file := range files {
		if filepath.Base(file) == "kustomization.yaml" {
			continue // kustomize's, rendered by TestKustomizeBase
		}
		raw, err := os.ReadFile(file)
		require.NoError(t, err)
		out = append(out, decodeManifests(t, filepath.Base(file), raw)...)
	}
	return out
}

// decodeManifests decodes the YAML documents of raw strictly, each into its
// k8s.io/api type (a ServiceMonitor into serviceMonitor, a PrometheusRule
// into prometheusRule); name says where
// they came from, for messages.
func decodeManifests(t *testing.T, name string, raw []byte) []object {
	t.Helper()
	var out []object
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(raw)))
	for i := 1; ; i++ {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err, name)
		where := name + ":" + strconv.Itoa(i)
		var fields map[string]any
		require.NoError(t, yaml.Unmarshal(doc, &fields), where)
		if len(fields) == 0 {
			continue // comments only
		}
		var tm metav1.TypeMeta
		require.NoError(t, yaml.Unmarshal(doc, &tm), where)
		gvk := schema.FromAPIVersionAndKind(tm.APIVersion, tm.Kind)
		var obj runtime.Object
		switch gvk {
		case serviceMonitorKind:
			obj = &serviceMonitor{}
		case prometheusRuleKind:
			obj = &prometheusRule{}
		default:
			obj, err = scheme.New(gvk)
			require.NoError(t, err, "%s: %s is not a kind deploy/ is checked for", where, gvk)
		}
		require.NoError(t, yaml.UnmarshalStrict(doc, obj), "%s: %s", where, gvk.Kind)
		meta, ok := obj.(metav1.Object)
		require.True(t, ok, where)
		require.NotEmpty(t, meta.GetName(), "%s: a name", where)
		out = append(out, object{where: where, gvk: gvk, obj: obj, meta: meta})
	}
	return out
}

// TestManifestsDecodeStrictly decodes every document of deploy/ into its
// k8s.io/api type, refusing unknown fields, and checks that the kinds
// deploy/ is meant to hold are all there (so that a glob that reads
// nothing cannot pass).
func TestManifestsDecodeStrictly(t *testing.T) {
	objs := readManifests(t)
	var kinds []string
	seen := map[string]string{}
	for _, o := range objs {
		kinds = append(kinds, o.gvk.Kind)
		key := o.gvk.Kind + "/" + o.meta.GetName()
		require.NotContains(t, seen, key, "%s: %s is defined again (first in %s)", o.where, key, seen[key])
		seen[key] = o.where
		require.Equal(t, "idemreg", o.meta.GetLabels()["app.kubernetes.io/name"], "%s: labelled as part of idemreg", o.where)
	}
	for _, want := range []string{"ConfigMap", "CronJob", "Deployment", "Job", "NetworkPolicy", "PodDisruptionBudget", "Secret", "Service", "ServiceAccount"} {
		require.Contains(t, kinds, want)
	}
}

// workload is a pod template of deploy/ and what runs it.
type workload struct {
	where string
	kind  string
	pod   corev1.PodTemplateSpec
}

func workloads(objs []object) []workload {
	var out []workload
	for _, o := range objs {
		switch w := o.obj.(type) {
		case *appsv1.Deployment:
			out = append(out, workload{o.where, "Deployment", w.Spec.Template})
		case *batchv1.Job:
			out = append(out, workload{o.where, "Job", w.Spec.Template})
		case *batchv1.CronJob:
			out = append(out, workload{o.where, "CronJob", w.Spec.JobTemplate.Spec.Template})
		}
	}
	return out
}

func named[T runtime.Object](objs []object) map[string]T {
	out := map[string]T{}
	for _, o := range objs {
		if v, ok := o.obj.(T); ok {
			out[o.meta.GetName()] = v
		}
	}
	return out
}

// TestManifestsAgree checks the objects of deploy/ against each other.
// Every workload (serve, sweep, migrate) runs the same image, non-root on a
// read-only root, as the ServiceAccount of deploy/ with no token mounted,
// and names only Secrets, keys and ConfigMaps that deploy/ defines. The
// Deployment's selector selects its own pods, and so do the Services, the
// PodDisruptionBudget and the NetworkPolicies, whose ingress ports and the
// Services' target ports are named ports of the container; every
// workload's pods are under a NetworkPolicy that limits their egress.
func TestManifestsAgree(t *testing.T) {
	checkAgree(t, readManifests(t))
}

// checkAgree is TestManifestsAgree's checks of objs, a rendering of the
// server's manifests with the Secrets they read.
func checkAgree(t *testing.T, objs []object) {
	t.Helper()
	secrets := named[*corev1.Secret](objs)
	configMaps := named[*corev1.ConfigMap](objs)
	accounts := named[*corev1.ServiceAccount](objs)
	ws := workloads(objs)
	require.Len(t, ws, 3, "serve, sweep and migrate")

	image := ws[0].pod.Spec.Containers[0].Image
	for _, w := range ws {
		spec := w.pod.Spec
		require.Contains(t, accounts, spec.ServiceAccountName, "%s: runs as the ServiceAccount of deploy/", w.where)
		require.NotNil(t, spec.AutomountServiceAccountToken, w.where)
		require.False(t, *spec.AutomountServiceAccountToken, "%s: no pod of idemreg calls the Kubernetes API", w.where)
		require.Equal(t, "idemreg", w.pod.Labels["app.kubernetes.io/name"], w.where)
		require.NotNil(t, spec.SecurityContext.RunAsNonRoot, w.where)
		require.True(t, *spec.SecurityContext.RunAsNonRoot, w.where)
		for _, c := range spec.Containers {
			require.Equal(t, image, c.Image, "%s: every workload runs the image of the Dockerfile", w.where)
			require.NotNil(t, c.SecurityContext.ReadOnlyRootFilesystem, w.where)
			require.True(t, *c.SecurityContext.ReadOnlyRootFilesystem, w.where)
			for _, e := range c.Env {
				if e.ValueFrom == nil {
					continue
				}
				if ref := e.ValueFrom.SecretKeyRef; ref != nil {
					require.Contains(t, secrets, ref.Name, "%s: env %s", w.where, e.Name)
					require.True(t, hasKey(secrets[ref.Name], ref.Key), "%s: env %s: Secret %s has key %s", w.where, e.Name, ref.Name, ref.Key)
				}
				if ref := e.ValueFrom.ConfigMapKeyRef; ref != nil {
					require.Contains(t, configMaps, ref.Name, "%s: env %s", w.where, e.Name)
				}
			}
		}
		for _, v := range spec.Volumes {
			if v.Secret != nil {
				require.Contains(t, secrets, v.Secret.SecretName, "%s: volume %s", w.where, v.Name)
			}
			if v.ConfigMap != nil {
				require.Contains(t, configMaps, v.ConfigMap.Name, "%s: volume %s", w.where, v.Name)
			}
		}
	}

	deployments := named[*appsv1.Deployment](objs)
	require.Len(t, deployments, 1)
	d := deployments["idemreg"]
	require.NotNil(t, d, "the Deployment idemreg")
	podLabels := labels.Set(d.Spec.Template.Labels)
	selects := func(where string, sel *metav1.LabelSelector) bool {
		s, err := metav1.LabelSelectorAsSelector(sel)
		require.NoError(t, err, where)
		return !s.Empty() && s.Matches(podLabels)
	}
	require.True(t, selects("Deployment", d.Spec.Selector), "the Deployment's selector selects its pods")
	portNames := map[string]bool{}
	for _, p := range d.Spec.Template.Spec.Containers[0].Ports {
		portNames[p.Name] = true
	}
	for name, svc := range named[*corev1.Service](objs) {
		require.True(t, selects(name, &metav1.LabelSelector{MatchLabels: svc.Spec.Selector}), "Service %s selects the Deployment's pods", name)
		for _, p := range svc.Spec.Ports {
			require.True(t, portNames[p.TargetPort.String()], "Service %s: targetPort %s is a named port of the container", name, p.TargetPort.String())
		}
	}
	for name, pdb := range named[*policyv1.PodDisruptionBudget](objs) {
		require.True(t, selects(name, pdb.Spec.Selector), "PodDisruptionBudget %s selects the Deployment's pods", name)
	}
	policies := named[*networkingv1.NetworkPolicy](objs)
	for name, np := range policies {
		require.True(t, selects(name, &np.Spec.PodSelector), "NetworkPolicy %s selects the Deployment's pods", name)
		for _, rule := range np.Spec.Ingress {
			for _, p := range rule.Ports {
				require.True(t, portNames[p.Port.String()], "NetworkPolicy %s: port %s is a named port of the container", name, p.Port.String())
			}
		}
	}
	// The sweep and migrate pods are held to the database and DNS too.
	for _, w := range ws {
		limited := false
		for _, np := range policies {
			sel, err := metav1.LabelSelectorAsSelector(&np.Spec.PodSelector)
			require.NoError(t, err)
			limited = limited || (slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeEgress) && sel.Matches(labels.Set(w.pod.Labels)))
		}
		require.True(t, limited, "%s: a NetworkPolicy limits where its pods connect", w.where)
	}
}

// TestMigrateJobLikeDeployment checks that the migrate Job sees the
// database as serve does: the same IDEMREG_* environment from the same
// sources, and the same image.
func TestMigrateJobLikeDeployment(t *testing.T) {
	objs := readManifests(t)
	d := named[*appsv1.Deployment](objs)["idemreg"]
	job := named[*batchv1.Job](objs)["idemreg-migrate"]
	require.NotNil(t, d)
	require.NotNil(t, job, "the Job idemreg-migrate")
	serve, migrate := d.Spec.Template.Spec.Containers[0], job.Spec.Template.Spec.Containers[0]
	require.Equal(t, serve.Image, migrate.Image)
	require.Equal(t, []string{"migrate"}, migrate.Args[:1])
	idemregEnv := func(c corev1.Container) []corev1.EnvVar {
		return slices.DeleteFunc(slices.Clone(c.Env), func(e corev1.EnvVar) bool { return !strings.HasPrefix(e.Name, "IDEMREG_") })
	}
	require.NotEmpty(t, idemregEnv(serve))
	require.Equal(t, idemregEnv(serve), idemregEnv(migrate))
	require.Equal(t, corev1.RestartPolicyNever, job.Spec.Template.Spec.RestartPolicy)
}

// hasKey reports whether the Secret s defines key, as data or stringData.
func hasKey(s *corev1.Secret, key string) bool {
	_, inString := s.StringData[key]
	_, inData := s.Data[key]
	return inString || inData
}
