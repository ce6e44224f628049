package slots

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestSourceParts: the slot script is its parts joined in order, every Lua
// file of the package among them once, each ending its last line, so that
// none runs into the next.
func TestSourceParts(t *testing.T) {
	files, err := filepath.Glob("*.lua")
	if err != nil {
		t.Fatal(err)
	}
	parts := slices.Sorted(slices.Values(sourceParts))
	if !slices.Equal(files, parts) {
		t.Errorf("Lua files %q, parts %q: want each file a part once", files, parts)
	}
	var joined strings.Builder
	for _, name := range sourceParts {
		b, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasSuffix(string(b), "\n") {
			t.Errorf("%s does not end its last line", name)
		}
		joined.Write(b)
	}
	if slotsSource != joined.String() {
		t.Error("the embedded script is not its parts joined in order")
	}
	if !strings.HasSuffix(Source("return 0"), "\nend\n"+joined.String()) {
		t.Error("Source does not end with the parts joined in order")
	}
}
