package main

import (
	"flag"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/config"
	"github.com/idemreg/idemreg/server"
	"github.com/idemreg/idemreg/server/policy"
	"github.com/idemreg/idemreg/storage/postgres"
)

// TestDeploySweepCronJob checks the CronJob in deploy/ against the binary:
// its arguments are flags `idemreg sweep` accepts and validates, and its
// deadlines leave the pass room to finish.
func TestDeploySweepCronJob(t *testing.T) {
	raw, err := os.ReadFile("../../deploy/base/sweep-cronjob.yaml")
	require.NoError(t, err)
	var cj struct {
		APIVersion string `yaml:"apiVersion"`
		Kind       string `yaml:"kind"`
		Spec       struct {
			Schedule          string `yaml:"schedule"`
			ConcurrencyPolicy string `yaml:"concurrencyPolicy"`
			JobTemplate       struct {
				Spec struct {
					ActiveDeadlineSeconds int `yaml:"activeDeadlineSeconds"`
					Template              struct {
						Spec struct {
							RestartPolicy string `yaml:"restartPolicy"`
							Containers    []struct {
								Args []string `yaml:"args"`
								Env  []struct {
									Name string `yaml:"name"`
								} `yaml:"env"`
							} `yaml:"containers"`
						} `yaml:"spec"`
					} `yaml:"template"`
				} `yaml:"spec"`
			} `yaml:"jobTemplate"`
		} `yaml:"spec"`
	}
	require.NoError(t, yaml.Unmarshal(raw, &cj))
	require.Equal(t, "batch/v1", cj.APIVersion)
	require.Equal(t, "CronJob", cj.Kind)
	require.Len(t, strings.Fields(cj.Spec.Schedule), 5)
	require.Equal(t, "Forbid", cj.Spec.ConcurrencyPolicy)
	job := cj.Spec.JobTemplate.Spec
	require.Equal(t, "Never", job.Template.Spec.RestartPolicy)
	require.Len(t, job.Template.Spec.Containers, 1)
	c := job.Template.Spec.Containers[0]
	require.Equal(t, "sweep", c.Args[0])
	require.Equal(t, "IDEMREG_DATABASE_URL", c.Env[0].Name)

	cfg := config.Default()
	fs := flag.NewFlagSet("sweep", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	cfg.BindSweep(fs)
	require.NoError(t, fs.Parse(c.Args[1:]), "the CronJob's arguments are flags of idemreg sweep")
	cfg.DatabaseURL = "postgres://from-the-secret/idemreg"
	require.NoError(t, cfg.Validate())
	require.Positive(t, cfg.Sweep.MaxDuration, "a cron pass is bounded")
	deadline := time.Duration(job.ActiveDeadlineSeconds) * time.Second
	require.Greater(t, deadline, cfg.Sweep.MaxDuration+cfg.Sweep.BatchTimeout,
		"Kubernetes must not kill the pod before --max-duration and a last batch")
}

// TestDeployMigrateJob checks the migrate Job in deploy/ against the binary:
// its arguments are accepted by idemreg migrate, which is left wanting only
// the database URL the Secret gives it, and its deadline outlasts a
// migration lock left by a run that was killed.
func TestDeployMigrateJob(t *testing.T) {
	raw, err := os.ReadFile("../../deploy/base/migrate-job.yaml")
	require.NoError(t, err)
	var job struct {
		APIVersion string `yaml:"apiVersion"`
		Kind       string `yaml:"kind"`
		Spec       struct {
			ActiveDeadlineSeconds int `yaml:"activeDeadlineSeconds"`
			Template              struct {
				Spec struct {
					RestartPolicy string `yaml:"restartPolicy"`
					Containers    []struct {
						Args []string `yaml:"args"`
						Env  []struct {
							Name      string `yaml:"name"`
							ValueFrom struct {
								SecretKeyRef *struct {
									Name string `yaml:"name"`
								} `yaml:"secretKeyRef"`
							} `yaml:"valueFrom"`
						} `yaml:"env"`
					} `yaml:"containers"`
				} `yaml:"spec"`
			} `yaml:"template"`
		} `yaml:"spec"`
	}
	require.NoError(t, yaml.Unmarshal(raw, &job))
	require.Equal(t, "batch/v1", job.APIVersion)
	require.Equal(t, "Job", job.Kind)
	require.Equal(t, "Never", job.Spec.Template.Spec.RestartPolicy)
	require.Len(t, job.Spec.Template.Spec.Containers, 1)
	c := job.Spec.Template.Spec.Containers[0]
	require.Equal(t, "migrate", c.Args[0])
	fromSecret := map[string]bool{}
	for _, e := range c.Env {
		fromSecret[e.Name] = e.ValueFrom.SecretKeyRef != nil
	}
	require.True(t, fromSecret["IDEMREG_DATABASE_URL"], "the database URL comes from the Secret, not the command line")

	// Without the Secret's URL, migrate parses its arguments and stops
	// before connecting anywhere.
	t.Setenv("IDEMREG_DATABASE_URL", "")
	err = run(t.Context(), c.Args, io.Discard, io.Discard)
	require.ErrorContains(t, err, "migrate needs --database-url", "the Job's arguments are flags of idemreg migrate")

	deadline := time.Duration(job.Spec.ActiveDeadlineSeconds) * time.Second
	require.Greater(t, deadline, postgres.MigrationLockTTL, "a lock left by a killed run expires before the Job is given up")
}

// TestDeployPolicyConfigMap checks that the policy in the ConfigMap in
// deploy/ is valid over the default flags.
func TestDeployPolicyConfigMap(t *testing.T) {
	raw, err := os.ReadFile("../../deploy/base/policy-configmap.yaml")
	require.NoError(t, err)
	var cm struct {
		Kind string            `yaml:"kind"`
		Data map[string]string `yaml:"data"`
	}
	require.NoError(t, yaml.Unmarshal(raw, &cm))
	require.Equal(t, "ConfigMap", cm.Kind)
	set, err := policy.Parse([]byte(cm.Data["policy.yaml"]), server.DefaultLimits().Policy())
	require.NoError(t, err)
	require.Equal(t, `prefix "orders."`, set.For("orders.inbox").Source)
	require.Equal(t, 8*24*time.Hour, set.For("orders.inbox").MessageRetention.Min)
}
