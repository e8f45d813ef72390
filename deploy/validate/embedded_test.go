package validate

import (
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

// flagValue is the value of --name=value in args, "" when absent.
func flagValue(args []string, name string) string {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v
		}
	}
	return ""
}

// TestEmbeddedManifest checks deploy/embedded against what serve does on
// the embedded store (docs/operations.md, "A full disk"): one pod at a
// time on the data directory (one replica, Recreate), the directory on
// the PersistentVolumeClaim the file defines, a reserve set, and the
// choice made for a store that fails for good: serve exits 75, the
// kubelet restarts the container (restartPolicy Always) and the exit's
// reason is the termination message; readiness on the health listener's
// overall status, liveness on its liveness service; and a grace period
// longer than the drain.
func TestEmbeddedManifest(t *testing.T) {
	objs := readManifestsIn(t, "../embedded/*.yaml")
	deployments := named[*appsv1.Deployment](objs)
	claims := named[*corev1.PersistentVolumeClaim](objs)
	require.Len(t, deployments, 1)
	d := deployments["idemreg"]
	require.NotNil(t, d)
	require.NotNil(t, d.Spec.Replicas)
	require.EqualValues(t, 1, *d.Spec.Replicas, "the data directory belongs to one process")
	require.Equal(t, appsv1.RecreateDeploymentStrategyType, d.Spec.Strategy.Type, "never two pods on the volume")
	spec := d.Spec.Template.Spec
	require.Contains(t, []corev1.RestartPolicy{"", corev1.RestartPolicyAlways}, spec.RestartPolicy, "serve exits for a restart")
	require.Len(t, spec.Containers, 1)
	c := spec.Containers[0]
	require.Equal(t, corev1.TerminationMessageFallbackToLogsOnError, c.TerminationMessagePolicy, "the exit's reason is in its last log lines")
	require.Equal(t, "serve", c.Args[0])
	require.Empty(t, flagValue(c.Args, "database-url"))

	dataDir := flagValue(c.Args, "data-dir")
	require.NotEmpty(t, dataDir)
	var mounted string
	for _, m := range c.VolumeMounts {
		if strings.HasPrefix(dataDir, m.MountPath+"/") || dataDir == m.MountPath {
			mounted = m.Name
			require.False(t, m.ReadOnly)
		}
	}
	require.NotEmpty(t, mounted, "--data-dir %s is on a volume", dataDir)
	i := slices.IndexFunc(spec.Volumes, func(v corev1.Volume) bool { return v.Name == mounted })
	require.GreaterOrEqual(t, i, 0)
	pvc := spec.Volumes[i].PersistentVolumeClaim
	require.NotNil(t, pvc, "the data directory outlives the pod")
	claim := claims[pvc.ClaimName]
	require.NotNil(t, claim, "the claim %s is in deploy/embedded", pvc.ClaimName)

	reserve, err := strconv.ParseInt(flagValue(c.Args, "data-dir-reserve"), 10, 64)
	require.NoError(t, err, "--data-dir-reserve set")
	size := claim.Spec.Resources.Requests[corev1.ResourceStorage]
	require.Positive(t, reserve)
	require.Less(t, reserve, size.Value()/4, "the reserve leaves most of the volume to records")

	require.NotNil(t, c.ReadinessProbe.GRPC)
	require.Nil(t, c.ReadinessProbe.GRPC.Service, "readiness is the overall status, NOT_SERVING when the store fails")
	require.Equal(t, "liveness", *c.LivenessProbe.GRPC.Service)
	health := flagValue(c.Args, "health-listen")
	require.True(t, strings.HasSuffix(health, ":"+strconv.Itoa(int(c.ReadinessProbe.GRPC.Port))), "probes reach --health-listen")

	drain, err := time.ParseDuration(flagValue(c.Args, "drain-delay"))
	require.NoError(t, err)
	shutdown, err := time.ParseDuration(flagValue(c.Args, "shutdown-timeout"))
	require.NoError(t, err)
	require.NotNil(t, spec.TerminationGracePeriodSeconds)
	require.Greater(t, time.Duration(*spec.TerminationGracePeriodSeconds)*time.Second, drain+shutdown)
}
