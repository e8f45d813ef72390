// Package postgres is the SQL storage backend, for PostgreSQL and
// CockroachDB.
package postgres
