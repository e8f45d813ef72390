// Package fence holds the tests of package client/fence that need
// PostgreSQL: fenced writes through database/sql and pgx, and concurrent
// holders racing on one key. They live in the tests module so that the
// client's own module requires no database driver.
package fence
