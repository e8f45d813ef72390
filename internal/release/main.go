// Command release builds what the release checks in .ci/ need from this
// checkout, without the network knowing our versions:
//
//	release proxy -out DIR [-version v0.1.0] [-released dir,dir...]
//	    a file:// GOPROXY directory (the GOPROXY protocol's layout: @v/list,
//	    .info, .mod, .zip) holding every Go module of this repository at the
//	    version that the repository's go.mod files require, zipped from the
//	    working tree with golang.org/x/mod/zip (the files git tracks or would
//	    track). It fails if two go.mod files require one of our modules at
//	    different versions, or if a released module's go.mod has a replace or
//	    exclude directive (go install pkg@version refuses those).
//
//	release vulndb -osv DIR -out DIR
//	    the Go vulnerability database in the v1 layout that govulncheck's
//	    -db file:// reads (index/db.json, index/modules.json, ID/<id>.json),
//	    built from the OSV entries of golang.org/x/vulndb's data/osv.
//
//	release vulnreport < govulncheck.json
//	    govulncheck's -format json findings, one line each; it fails on any
//	    in a required module (at the module, package or symbol level), and
//	    lists those of the standard library, which are the running
//	    toolchain's.
//
// It is a module of its own (docs/design.md, "Modules") so that its
// requirements reach none of the modules a service imports.
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "proxy":
		fs := flag.NewFlagSet("proxy", flag.ExitOnError)
		repo := fs.String("repo", ".", "the repository's root")
		out := fs.String("out", "", "the GOPROXY directory to write (created; emptied first)")
		version := fs.String("version", "", "the version of every module of ours (default: the one the go.mod files require)")
		released := fs.String("released", "", "comma-separated module directories a user imports: no replace or exclude allowed there")
		_ = fs.Parse(os.Args[2:])
		if *out == "" {
			usage()
		}
		var dirs []string
		if *released != "" {
			dirs = strings.Split(*released, ",")
		}
		var mods []served
		mods, err = buildProxy(*repo, *out, *version, dirs)
		for _, m := range mods {
			fmt.Printf("%s (%s)\n", m.Version, m.Dir)
		}
	case "vulndb":
		fs := flag.NewFlagSet("vulndb", flag.ExitOnError)
		osvDir := fs.String("osv", "", "a directory of OSV entries (golang.org/x/vulndb's data/osv)")
		out := fs.String("out", "", "the database directory to write (created; emptied first)")
		_ = fs.Parse(os.Args[2:])
		if *osvDir == "" || *out == "" {
			usage()
		}
		var n int
		n, err = buildVulnDB(*osvDir, *out)
		if err == nil {
			fmt.Printf("%d entries in %s\n", n, *out)
		}
	case "vulnreport":
		err = vulnReport(os.Stdin, os.Stdout)
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "release:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: release proxy -out DIR [-repo DIR] [-version vX.Y.Z] [-released dir,...]")
	fmt.Fprintln(os.Stderr, "       release vulndb -osv DIR -out DIR")
	fmt.Fprintln(os.Stderr, "       release vulnreport < govulncheck.json")
	os.Exit(2)
}
