package main

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/redistest"
)

// awkwardNames are bucket names that a shell, a terminal or a line-based
// reader would take apart: blanks, quotes, shell syntax, control
// characters, bytes that are not UTF-8, invisible runes, a leading "-".
var awkwardNames = []string{
	"api.example.com", "my bucket", "line\nbreak", "trailing\n", "tab\tand\rcr", "it's", "'quoted'", "$(touch pwned)",
	"`touch pwned`", `back\slash`, `quote"d`, "bücher.example", "bell\a\x1b[31mred", "bad\xffutf8", "\u202eevil",
	"-dash", "}brace", "%pct", "a=b,c:d@e/f+g", "$'x'", "!event",
}

// shellWord returns what bash makes of word, typed as one argument.
func shellWord(t *testing.T, dir, word string) string {
	t.Helper()
	cmd := exec.Command("bash", "--norc", "--noprofile", "-c", "printf %s "+word)
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("bash -c 'printf %%s %s': %v", word, err)
	}
	return string(out)
}

// TestNamesPasteBack: list prints every name on one line, in a form that
// bash reads back as the name, and that status, limit, pause and resume
// take as the name when given as it is, as a script reading list's lines
// passes it; status and the actions print the name in the same form.
func TestNamesPasteBack(t *testing.T) {
	if _, err := exec.LookPath("bash"); err != nil {
		t.Skip("no bash to paste the names into")
	}
	srv := redistest.Start(t)
	ctx := context.Background()
	l := quota.NewLimiter(srv.Client(t))
	flags := []string{"-redis", srv.Addr()}
	names := slices.Clone(awkwardNames)
	for _, name := range names {
		if err := l.SetLimit(ctx, name, quota.PerSecond(4)); err != nil {
			t.Fatal(err)
		}
	}
	slices.Sort(names)

	var got []listed
	if err := json.Unmarshal([]byte(mustRun(t, nil, append(flags, "list", "-json")...)), &got); err != nil || len(got) != len(names) {
		t.Fatalf("quotactl list -json: %+v, %v; want %d buckets", got, err, len(names))
	}
	// JSON has no string for bytes that are not UTF-8: it writes U+FFFD
	// for each.
	for i, b := range got {
		if b.Name != strings.ToValidUTF8(names[i], "\uFFFD") || b.Shortened {
			t.Errorf("quotactl list -json: bucket %d is %+v, want %q", i, b, names[i])
		}
	}

	out := mustRun(t, nil, append(flags, "list")...)
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if len(lines) != len(names) {
		t.Fatalf("quotactl list printed %d lines for %d buckets: %q", len(lines), len(names), out)
	}
	dir := t.TempDir()
	for i, line := range lines {
		name := names[i]
		if got := shellWord(t, dir, line); got != name {
			t.Errorf("quotactl list printed %s for %q; bash reads it as %q", line, name, got)
		}
		if strings.ContainsFunc(line, func(r rune) bool { return r < ' ' || r == 0x7f || r == '\u202e' }) {
			t.Errorf("quotactl list printed %q for %q: a control character or an invisible rune", line, name)
		}

		// The line as it is, after "--" for a name that begins with "-".
		js := mustRun(t, nil, append(flags, "status", "-json", "--", line)...)
		if m, err := decode(js); err != nil || m["name"] != strings.ToValidUTF8(name, "\uFFFD") || m["override"] == nil {
			t.Errorf("quotactl status -json -- %s = %s, %v; want the bucket %q", line, js, err, name)
		}
		text := mustRun(t, nil, append(flags, "status", "--", line)...)
		if !strings.HasPrefix(text, "bucket   "+line+"\n") || strings.Count(text, "\n") != 7 {
			t.Errorf("quotactl status -- %s printed %q; want the name as list prints it, on seven lines", line, text)
		}
		for _, args := range [][]string{{"pause", "--", line, "1m"}, {"limit", "--", line, "3/s"}} {
			text := mustRun(t, nil, append(flags, args...)...)
			if !strings.HasPrefix(text, line+": ") || strings.Count(text, "\n") != 1 {
				t.Errorf("quotactl %q printed %q; want one line that begins with the name as list prints it", args, text)
			}
		}
		if st, err := l.Status(ctx, name); err != nil || !st.Paused || st.Override == nil || st.Override.Rate != 3 {
			t.Errorf("after quotactl pause and limit -- %s: Status(%q) = %+v, %v", line, name, st, err)
		}
		mustRun(t, nil, append(flags, "resume", "--", line)...)
		mustRun(t, nil, append(flags, "limit", "--", line, "off")...)
		if st, err := l.Status(ctx, name); err != nil || st.Paused || st.Override != nil {
			t.Errorf("after quotactl resume and limit off -- %s: Status(%q) = %+v, %v", line, name, st, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "pwned")); err == nil {
		t.Errorf("a name that list printed ran a command in bash")
	}
}

// TestShortenedName: a name over 200 bytes, which Redis keeps as its first
// bytes and a digest, is listed in that form and marked; status, limit,
// pause and resume refuse that form, which is no bucket's name, rather
// than act on another bucket, and take the whole name.
func TestShortenedName(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	rdb := srv.Client(t)
	l := quota.NewLimiter(rdb)
	flags := []string{"-redis", srv.Addr()}
	long := strings.Repeat("long name ", 30)
	if err := l.SetLimit(ctx, long, quota.PerSecond(4)); err != nil {
		t.Fatal(err)
	}
	out := mustRun(t, nil, append(flags, "list")...)
	shown, note, ok := strings.Cut(strings.TrimSuffix(out, "\n"), "  (shortened")
	if !ok || strings.Contains(out[:len(out)-1], "\n") || !strings.Contains(note, "whole name") {
		t.Fatalf("quotactl list printed %q; want one line, the shortened name marked as such", out)
	}
	keys := rdb.DBSize(ctx).Val()
	for _, args := range [][]string{{"status", shown}, {"status", "-json", shown}, {"limit", shown, "3/s"}, {"limit", shown, "off"},
		{"pause", shown, "1m"}, {"resume", shown}} {
		code, out, errOut := quotaRun(nil, append(flags, args...)...)
		if code != 2 || out != "" || !strings.HasPrefix(errOut, "quotactl: "+args[0]+": ") || !strings.Contains(errOut, "shortened") ||
			!strings.Contains(errOut, "whole name") || strings.Count(errOut, "\n") != 2 {
			t.Errorf("quotactl %s on the name list shortened: exit %d, stdout %q, stderr %q; want exit 2 and why", args[0], code, out, errOut)
		}
	}
	if n := rdb.DBSize(ctx).Val(); n != keys {
		t.Errorf("quotactl on the shortened name left %d keys, want the %d there were", n, keys)
	}
	// The whole name reaches the bucket.
	if text := mustRun(t, nil, append(flags, "status", long)...); !strings.Contains(text, "limit    4/s, burst 12 (override)") {
		t.Errorf("quotactl status of the whole name printed %q, want its override", text)
	}
}

// TestDashName: a name that begins with "-", pasted after the subcommand,
// is taken for a flag; the error says to put it after "--".
func TestDashName(t *testing.T) {
	code, _, errOut := quotaRun(nil, "status", "-dash")
	if code != 2 || !strings.Contains(errOut, "-dash") || !strings.Contains(errOut, `after "--"`) {
		t.Errorf("quotactl status -dash: exit %d, stderr %q; want exit 2 and the way to name the bucket", code, errOut)
	}
}

// TestQuoteName: the three forms of a printed name, and what a NAME
// argument stands for.
func TestQuoteName(t *testing.T) {
	for _, tc := range []struct{ name, want string }{
		{"api.example.com", "api.example.com"},
		{"a=b,c:d@e/f+g%h_i-j", "a=b,c:d@e/f+g%h_i-j"},
		{"-dash", "-dash"},
		{"my bucket", "'my bucket'"},
		{"it's", `'it'\''s'`},
		{"$(rm -rf /)", "'$(rm -rf /)'"},
		{"bücher", "'bücher'"},
		{"", "''"},
		{"line\nbreak", `$'line\nbreak'`},
		{"tab\tcr\r'\\", `$'tab\tcr\r\'\\'`},
		{"esc\x1b[1m bücher", `$'esc\033[1m bücher'`},
		{"bad\xffutf8\x00", `$'bad\377utf8\000'`},
		{"\u202eevil", `$'\342\200\256evil'`},
		{"nbsp\u00a0", `$'nbsp\302\240'`},
		{"\x015", `$'\0015'`},
	} {
		if got := quoteName(tc.name); got != tc.want {
			t.Errorf("quoteName(%q) = %s, want %s", tc.name, got, tc.want)
		}
		if got := unquoteName(tc.want); got != tc.name {
			t.Errorf("unquoteName(%s) = %q, want %q", tc.want, got, tc.name)
		}
	}
	for _, tc := range []struct{ arg, want string }{
		{"'a'\\''b'", "a'b"},
		{"'my'-bucket", "my-bucket"},
		{`$'\x41\x4a\x4Bc'`, "AJ\x4bc"},
		{`$'\e\a\b\f\v\"\?'`, "\x1b\a\b\f\v\"?"},
		{`$'\1\12\1234'`, "\x01\n\x534"},
		{"'a'$'\\n'b", "a\nb"},
		{"\\'x", "\\'x"}, // not quoted: the name itself
		// Not a whole quoted word: the name itself.
		{"'open", "'open"},
		{"'a' 'b'", "'a' 'b'"},
		{"'a'b c", "'a'b c"},
		{`$'\u00e9'`, `$'\u00e9'`},
		{`$'\cA'`, `$'\cA'`},
		{`$'\x'`, `$'\x'`},
		{`$'open`, `$'open`},
		{`$'a\`, `$'a\`},
		{"don't", "don't"},
		{`"quoted"`, `"quoted"`},
		{"$x", "$x"},
	} {
		if got := unquoteName(tc.arg); got != tc.want {
			t.Errorf("unquoteName(%s) = %q, want %q", tc.arg, got, tc.want)
		}
	}
}

// TestQuoteNameRoundTrip: every name, whatever its bytes, prints on one
// line, without a control byte, and reads back as itself.
func TestQuoteNameRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	alphabet := []string{"a", "Z", "0", " ", "'", `"`, "\\", "$", "`", "!", "\n", "\t", "\r", "\x00", "\x1b", "\x7f", "\xff", "\xc3", "é", "\u202e", "\u00a0", "~", "-", "%", "}", "{", "*"}
	for range 20000 {
		var b strings.Builder
		for range rng.IntN(12) + 1 {
			b.WriteString(alphabet[rng.IntN(len(alphabet))])
		}
		name := b.String()
		q := quoteName(name)
		if got := unquoteName(q); got != name {
			t.Fatalf("unquoteName(quoteName(%q)) = %q via %s", name, got, q)
		}
		if strings.ContainsFunc(q, func(r rune) bool {
			return r < ' ' || r == 0x7f || r == utf8.RuneError || !unicode.IsPrint(r) && r != ' '
		}) {
			t.Fatalf("quoteName(%q) = %q: a control byte or an invisible rune", name, q)
		}
	}
}

// TestIsShortened: the form list prints for a name over 200 bytes, and
// nothing else.
func TestIsShortened(t *testing.T) {
	long := strings.Repeat("x", 300)
	shown, _ := bucketOf("quota:", bucketKey("quota:", long))
	if !shown.Shortened || !isShortened(shown.Name) {
		t.Errorf("isShortened(%q) = false; want true for the form list prints", shown.Name)
	}
	for _, name := range []string{long, long[:200], long[:201], shown.Name[:200], shown.Name + "0",
		strings.ToUpper(shown.Name), strings.Replace(shown.Name, "~", "-", 1)} {
		if isShortened(name) {
			t.Errorf("isShortened(%q) = true", name)
		}
	}
}
