package quota_test

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/doc"
	"go/format"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// The Go blocks of the docs are the code of runnable Examples, so that
// they compile and do what the docs say. The convention:
//
//   - A ```go block of README.md or of a page docs/*.md is the code of one
//     Example function in the example*_test.go files of the package or of
//     a package beside it (exampleDirs): the lines
//     between a "// README:" comment and the next "// end README" comment
//     in the Example's body, and when the Example has several such regions,
//     their lines one after the other. The lines outside the regions set up
//     the stand-ins (a miniredis, a provider) and print what the Example
//     shows.
//   - A block that begins with "package main" is a whole program: its func
//     main's body is compared instead, and the program must be gofmt'ed and
//     pass go vet.
//   - Lines compare with their indentation and runs of blanks ignored, and
//     blank lines dropped; comments count.
//   - The Example must have an output comment, so that go test runs it, and
//     every Example with regions must be shown by some block.

const (
	regionStart = "// README:"
	regionEnd   = "// end README"
)

// exampleDirs are the directories of the packages whose Examples the docs
// show: the root's and package llm's.
var exampleDirs = []string{".", "llm"}

// shown is the code an Example shows in the docs.
type shown struct {
	name   string   // the Example's function name
	pos    string   // file:line of the function
	lines  []string // its regions' lines, normalised
	output bool     // it has an output comment
}

func TestREADMEGoBlocksAreExamples(t *testing.T) {
	t.Parallel()
	examples := readExamples(t)
	docs := append([]string{"README.md"}, glob(t, "docs/*.md")...)
	used := map[string]bool{}
	blocks := 0
	for _, file := range docs {
		for _, b := range goBlocks(t, file) {
			blocks++
			code := b.code
			if strings.HasPrefix(code, "package ") {
				var ok bool
				if code, ok = programMain(t, b); !ok {
					continue
				}
			}
			want := normalise(code)
			i := slices.IndexFunc(examples, func(e shown) bool { return slices.Equal(e.lines, want) })
			if i < 0 {
				t.Errorf("%s:%d: this Go block is not the code between %q and %q of any Example in example*_test.go:\n%s%s",
					file, b.line, regionStart, regionEnd, indent(code), nearest(examples, want))
				continue
			}
			e := examples[i]
			used[e.pos] = true
			if !e.output {
				t.Errorf("%s:%d: the block is %s (%s), which has no output comment, so go test does not run it", file, b.line, e.name, e.pos)
			}
		}
	}
	if blocks == 0 {
		t.Fatal("no Go block in README.md or docs/*.md: the test reads the wrong files")
	}
	for _, e := range examples {
		if !used[e.pos] {
			t.Errorf("%s: %s marks code for the docs, but no block of README.md or docs/*.md shows it", e.pos, e.name)
		}
	}
}

// readExamples returns the Examples of the example files of exampleDirs
// that mark code for the docs.
func readExamples(t *testing.T) []shown {
	t.Helper()
	var out []shown
	for _, dir := range exampleDirs {
		out = append(out, readDirExamples(t, dir)...)
	}
	return out
}

// readDirExamples returns the Examples of dir's example files that mark
// code for the docs.
func readDirExamples(t *testing.T, dir string) []shown {
	t.Helper()
	fset := token.NewFileSet()
	var files []*ast.File
	var out []shown
	for _, path := range glob(t, filepath.Join(dir, "example*_test.go")) {
		src, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		f, err := parser.ParseFile(fset, path, src, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
		lines := strings.Split(string(src), "\n")
		inExample := map[*ast.Comment]bool{}
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Recv != nil || !strings.HasPrefix(fn.Name.Name, "Example") || fn.Body == nil {
				continue
			}
			var region []string
			open := 0 // line of the open region's start marker, or 0
			for _, g := range f.Comments {
				for _, c := range g.List {
					if c.Pos() < fn.Body.Lbrace || c.End() > fn.Body.Rbrace || !isMarker(c.Text) {
						continue
					}
					inExample[c] = true
					line := fset.Position(c.Pos()).Line
					switch {
					case c.Text == regionStart && open == 0:
						open = line
					case c.Text == regionEnd && open != 0:
						region = append(region, lines[open:line-1]...) // lines open+1 ... line-1, 1-based
						open = 0
					default:
						t.Errorf("%s: %q out of place in %s: the regions are %q ... %q, one after another",
							fset.Position(c.Pos()), c.Text, fn.Name.Name, regionStart, regionEnd)
					}
				}
			}
			if open != 0 {
				t.Errorf("%s:%d: %s has a %q without its %q", path, open, fn.Name.Name, regionStart, regionEnd)
			}
			if region != nil {
				out = append(out, shown{
					name:  fn.Name.Name,
					pos:   fset.Position(fn.Pos()).String(),
					lines: normalise(strings.Join(region, "\n")),
				})
			}
		}
		for _, g := range f.Comments {
			for _, c := range g.List {
				if isMarker(c.Text) && !inExample[c] {
					t.Errorf("%s: %q outside the body of an Example", fset.Position(c.Pos()), c.Text)
				}
			}
		}
	}
	withOutput := map[string]bool{}
	for _, ex := range doc.Examples(files...) {
		if ex.Output != "" || ex.EmptyOutput {
			withOutput["Example"+ex.Name] = true
		}
	}
	for i := range out {
		out[i].output = withOutput[out[i].name]
	}
	return out
}

func isMarker(text string) bool {
	text = strings.TrimSpace(text)
	return strings.HasPrefix(text, regionStart) || strings.HasPrefix(text, regionEnd)
}

// block is a fenced Go block of a Markdown file.
type block struct {
	file string
	line int // of its first line of code
	code string
}

// goBlocks returns the ```go blocks of the Markdown file.
func goBlocks(t *testing.T, file string) []block {
	t.Helper()
	src, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var out []block
	var cur *block
	var code []string
	for i, line := range strings.Split(string(src), "\n") {
		switch {
		case cur == nil && strings.TrimRight(line, " ") == "```go":
			cur, code = &block{file: file, line: i + 2}, nil
		case cur != nil && strings.TrimRight(line, " ") == "```":
			cur.code = strings.Join(code, "\n") + "\n"
			out = append(out, *cur)
			cur = nil
		case cur != nil:
			code = append(code, line)
		}
	}
	if cur != nil {
		t.Errorf("%s:%d: a Go block without its closing fence", file, cur.line-1)
	}
	return out
}

// programMain checks the whole program b and returns its func main's body.
func programMain(t *testing.T, b block) (string, bool) {
	t.Helper()
	formatted, err := format.Source([]byte(b.code))
	if err != nil {
		t.Errorf("%s:%d: the program does not parse: %v", b.file, b.line, err)
		return "", false
	}
	if !bytes.Equal(formatted, []byte(b.code)) {
		t.Errorf("%s:%d: the program is not gofmt'ed; gofmt makes it\n%s", b.file, b.line, indent(string(formatted)))
	}
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "main.go", b.code, 0)
	if err != nil {
		t.Errorf("%s:%d: %v", b.file, b.line, err)
		return "", false
	}
	var body string
	for _, d := range f.Decls {
		if fn, ok := d.(*ast.FuncDecl); ok && fn.Name.Name == "main" && fn.Recv == nil && fn.Body != nil {
			body = b.code[fset.Position(fn.Body.Lbrace).Offset+1 : fset.Position(fn.Body.Rbrace).Offset]
		}
	}
	if f.Name.Name != "main" || body == "" {
		t.Errorf("%s:%d: a program must be package main with a func main", b.file, b.line)
		return "", false
	}
	vetProgram(t, b)
	return body, true
}

// vetProgram runs go vet on the program b, in a module of its own that
// uses this one, offline.
func vetProgram(t *testing.T, b block) {
	t.Helper()
	if testing.Short() {
		t.Logf("%s:%d: go vet of the program skipped under -short", b.file, b.line)
		return
	}
	root, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	gomod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	// The program's module requires what this one does, so that its graph
	// is the pruned one already in the module cache: resolving a module
	// that names only quota reads the go.mod of every version its
	// dependencies ever required, which an offline cache need not hold.
	dir := t.TempDir()
	mod := fmt.Sprintf("module example.com/readme\n\ngo 1.26.0\n\nrequire github.com/sharedquota/quota v0.0.0\n\nreplace github.com/sharedquota/quota => %s\n", root)
	for _, line := range strings.SplitAfter(string(gomod), "\n") {
		if strings.HasPrefix(line, "require") || strings.HasPrefix(line, "\t") || strings.HasPrefix(line, ")") {
			mod += line
		}
	}
	for name, data := range map[string][]byte{"go.mod": []byte(mod), "go.sum": sum, "main.go": []byte(b.code)} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	gobin, err := exec.LookPath("go") // go test puts its own go first in PATH
	if err != nil {
		t.Logf("%s:%d: go vet of the program skipped: %v", b.file, b.line, err)
		return
	}
	cmd := exec.Command(gobin, "vet", ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOPROXY=off", "GOWORK=off", "GOTOOLCHAIN=local")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("%s:%d: go vet of the program: %v\n%s", b.file, b.line, err, indent(string(out)))
	}
}

// normalise returns the lines of code without their indentation, runs of
// blanks or blank lines.
func normalise(code string) []string {
	var out []string
	for _, line := range strings.Split(code, "\n") {
		if f := strings.Fields(line); len(f) > 0 {
			out = append(out, strings.Join(f, " "))
		}
	}
	return out
}

// nearest describes the Example whose marked code shares most lines with
// want, to show where a block drifted.
func nearest(examples []shown, want []string) string {
	best, score := -1, 0
	for i, e := range examples {
		n := 0
		for _, l := range want {
			if slices.Contains(e.lines, l) {
				n++
			}
		}
		if n > score {
			best, score = i, n
		}
	}
	if best < 0 {
		return ""
	}
	e := examples[best]
	return fmt.Sprintf("the nearest is %s (%s), which marks\n%s", e.name, e.pos, indent(strings.Join(e.lines, "\n")+"\n"))
}

func indent(s string) string {
	return "\t" + strings.ReplaceAll(strings.TrimSuffix(s, "\n"), "\n", "\n\t") + "\n"
}

func glob(t *testing.T, pattern string) []string {
	t.Helper()
	m, err := filepath.Glob(pattern)
	if err != nil {
		t.Fatal(err)
	}
	return m
}
