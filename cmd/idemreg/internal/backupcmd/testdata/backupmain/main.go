// Command backupmain is backupcmd.Run made slow on purpose, for the test
// that SIGKILLs a backup midway: every ReadBackup asks for 4 KiB and waits
// $BACKUP_TEST_READ_DELAY first.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idemreg/idemreg/cmd/idemreg/internal/backupcmd"
	idemregv1 "github.com/idemreg/idemreg/proto/idemreg/v1"
)

func main() {
	addr := flag.String("addr", "", "the server")
	to := flag.String("to", "", "a directory, or -")
	flag.Parse()
	delay, _ := time.ParseDuration(os.Getenv("BACKUP_TEST_READ_DELAY"))
	slow := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if r, ok := req.(*idemregv1.ReadBackupRequest); ok && strings.HasSuffix(method, "/ReadBackup") {
			r.MaxBytes = 4096
			time.Sleep(delay)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	cc, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithUnaryInterceptor(slow))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	call := func(ctx context.Context) (context.Context, context.CancelFunc) {
		return context.WithTimeout(ctx, time.Minute)
	}
	m, err := backupcmd.Run(context.Background(), idemregv1.NewAdminServiceClient(cc), call, *to, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	backupcmd.PrintManifest(os.Stderr, m, *to)
}
