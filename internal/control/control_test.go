package control

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/store"
)

// A record's times, whoever wrote them, stay within a century of the
// server's clock, without overflowing a Duration.
func TestRecordTimesStayInRange(t *testing.T) {
	cmd := redis.NewCmd(context.Background())
	cmd.SetVal([]any{"1000000", "", "", "1", "9223372036854775807", "", "", "1", "-9223372036854775808 0 1", "", ""})
	r, err := store.ParseRecord(cmd)
	if err != nil {
		t.Fatal(err)
	}
	sent := time.Now()
	st := stateOf(r, sent)
	if end, _, paused := st.PausedAt(sent); !paused || end.Before(sent.Add(99*365*24*time.Hour)) {
		t.Errorf("a pause until the end of int64 µs: paused %v until %v, want a century on", paused, end)
	}
	if due, _ := st.Due([]float64{0}, func(int) bool { return true }); st.Local(due).After(sent) || st.Local(due).Before(sent.Add(-101*365*24*time.Hour)) {
		t.Errorf("an anchor at the start of int64 µs read as due %v", due)
	}
}

func TestParse(t *testing.T) {
	for _, c := range []struct {
		payload string
		want    Announcement
	}{
		{"quota:{a}", Announcement{Kind: Changed, Key: "quota:{a}"}},
		{"s id1=5 id2\nquota:{a}", Announcement{Kind: Handed, Key: "quota:{a}", Body: "id1=5 id2"}},
		{"b 7 1=2\nquota:{a}", Announcement{Kind: GaveBack, Key: "quota:{a}", Body: "7 1=2"}},
		{"p 9 0:=3\nquota:{a}", Announcement{Kind: Pushed, Key: "quota:{a}", Body: "9 0:=3"}},
		{"s id1", Announcement{}},
	} {
		if got := Parse(c.payload); got != c.want {
			t.Errorf("Parse(%q) = %+v, want %+v", c.payload, got, c.want)
		}
	}
}
