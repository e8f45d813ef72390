package configfile

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Observe reports which file is in force, as idemreg_config_info{version}
// 1, made by meters: after a change on disk, whether every replica took it
// (a refused file keeps the old version). A source without a file reports
// nothing.
func (s *Source) Observe(meters metric.MeterProvider) error {
	if s.path == "" {
		return nil
	}
	_, err := meters.Meter("github.com/idemreg/idemreg/server/configfile").Int64ObservableGauge("idemreg.config.info",
		metric.WithDescription("The config file (--config) in force: 1, its version the first 12 hex digits of the file's SHA-256."),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			o.Observe(1, metric.WithAttributes(attribute.String("version", s.Current().Version)))
			return nil
		}))
	return err
}
