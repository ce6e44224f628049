package usage

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

// fed tells how chunks fed the input, for a failure's message.
func fed(chunks []string) string {
	return fmt.Sprintf("fed in %d Writes, the first of %d bytes", len(chunks), len(chunks[0]))
}

// splits returns the ways the tests feed input: whole, in every split into
// two Writes, and one byte at a time.
func splits(input string) [][]string {
	ways := [][]string{{input}}
	for i := 1; i < len(input); i++ {
		ways = append(ways, []string{input[:i], input[i:]})
	}
	if len(input) < 2 {
		return ways
	}
	bytes := make([]string, len(input))
	for i := range len(input) {
		bytes[i] = input[i : i+1]
	}
	return append(ways, bytes)
}

const (
	openAI = `{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":` +
		`{"role":"assistant","content":"he said \"usage\": {x}"}}],` +
		`"usage":{"prompt_tokens":12,"completion_tokens":34,"total_tokens":46}}`
	anthropic = `{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"text",` +
		`"text":"usage: {\"usage\":1} \\ é 世界 \u00e9"}],"stop_reason":"end_turn",` +
		`"usage":{"input_tokens":10,"output_tokens":20}}`
)

var fieldTests = []struct {
	name string
	body string
	max  int
	want string // the value, or "" for none
}{
	{"openai", openAI, 256, `{"prompt_tokens":12,"completion_tokens":34,"total_tokens":46}`},
	{"anthropic", anthropic, 256, `{"input_tokens":10,"output_tokens":20}`},
	{"whitespace", "\r\n {\n  \"usage\" :\t{\n    \"a\": [1, 2]\n  } ,\n  \"id\": \"x\"\n}\n",
		256, "{\n    \"a\": [1, 2]\n  }"},
	{"nested only", `{"choices":[{"usage":{"x":1}}],"meta":{"usage":2},"s":"\"usage\":3"}`, 256, ""},
	{"null", `{"usage":null}`, 256, ""},
	{"null after a value", `{"usage":{"a":1},"usage": null }`, 256, ""},
	{"last occurrence", `{"usage":1,"usage":{"b":2}}`, 256, `{"b":2}`},
	{"number", `{"usage": -1.5e3 , "id":1}`, 256, "-1.5e3"},
	{"number last", "{\"usage\":7\n}", 256, "7"},
	{"true", `{"usage":true}`, 256, "true"},
	{"string", `{"usage":"a \"b\" \\","id":"c"}`, 256, `"a \"b\" \\"`},
	{"array", `{"a":[[{"usage":1}],"]"],"usage":[1,{"b":"}]"}],"c":2}`, 256, `[1,{"b":"}]"}]`},
	{"keys with escapes", `{"us\"age":1,"usage\\":2,"us\u0061ge":3,"usag":4,"usages":5}`, 256, ""},
	{"key after escapes", `{"usage\\":2,"usage":3}`, 256, "3"},
	{"exactly max", `{"usage":{"a":1}}`, 7, `{"a":1}`},
	{"over max", `{"usage":{"a":12}}`, 7, ""},
	{"over max scalar", `{"usage":12345678}`, 7, ""},
	{"over max, then fits", `{"usage":"0123456789","usage":{"a":1}}`, 7, `{"a":1}`},
	{"fits, then over max", `{"usage":{"a":1},"usage":"0123456789"}`, 7, ""},
	{"cut in the value", `{"usage":{"a":1`, 256, ""},
	{"cut after a scalar", `{"usage":12`, 256, ""},
	{"cut after an object", `{"usage":{"a":1}`, 256, `{"a":1}`},
	{"not an object", `[{"usage":1}]`, 256, ""},
	{"no colon", `{"usage" 1}`, 256, ""},
	{"no value", `{"usage":}`, 256, ""},
	{"two scalars", `{"usage":1 2}`, 256, ""},
	{"leading comma", `{,"usage":1}`, 256, ""},
	{"after the object", `{"a":1} {"usage":1}`, 256, ""},
	{"bare", `"usage":1`, 256, ""},
	{"empty", ``, 256, ""},
	{"unbalanced", `{"a":]]]]}}}}, "usage":1}`, 256, ""},
}

func TestField(t *testing.T) {
	for _, tc := range fieldTests {
		t.Run(tc.name, func(t *testing.T) {
			for _, chunks := range splits(tc.body) {
				f := NewField("usage", tc.max)
				for _, c := range chunks {
					if n, err := f.Write([]byte(c)); n != len(c) || err != nil {
						t.Fatalf("Write(%q) = %d, %v", c, n, err)
					}
				}
				got, ok := f.Value()
				if string(got) != tc.want || ok != (tc.want != "") {
					t.Fatalf("%s: Value() = %q, %v; want %q", fed(chunks), got, ok, tc.want)
				}
			}
		})
	}
}

func TestFieldReset(t *testing.T) {
	f := NewField("usage", 256)
	f.Write([]byte(openAI))
	f.Reset()
	if v, ok := f.Value(); ok {
		t.Fatalf("Value() after Reset = %q, want none", v)
	}
	f.Write([]byte(anthropic))
	if v, _ := f.Value(); string(v) != `{"input_tokens":10,"output_tokens":20}` {
		t.Fatalf("Value() of the object after Reset = %q", v)
	}
}

// A value far longer than max is not kept, its bytes or their room.
func TestFieldBounded(t *testing.T) {
	f := NewField("usage", 100)
	f.Write([]byte(`{"usage":"`))
	chunk := []byte(strings.Repeat("x", 1000))
	for range 1000 {
		f.Write(chunk)
	}
	f.Write([]byte(`"}`))
	if v, ok := f.Value(); ok {
		t.Fatalf("Value() = %d bytes, want none over max", len(v))
	}
	if cap(f.val) > 2*100 {
		t.Fatalf("kept room for %d bytes of a value of at most 100", cap(f.val))
	}
}

func FuzzField(f *testing.F) {
	for _, tc := range fieldTests {
		f.Add(tc.body)
	}
	f.Fuzz(func(t *testing.T, body string) {
		whole := NewField("usage", 64)
		whole.Write([]byte(body))
		bytes := NewField("usage", 64)
		for i := range len(body) {
			bytes.Write([]byte{body[i]})
		}
		v1, ok1 := whole.Value()
		v2, ok2 := bytes.Value()
		if string(v1) != string(v2) || ok1 != ok2 {
			t.Fatalf("whole: %q, %v; one byte at a time: %q, %v", v1, ok1, v2, ok2)
		}
	})
}

const (
	openAIStream = "data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n" +
		"data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1,\"total_tokens\":6}}\n\n" +
		"data: [DONE]\n\n"
	anthropicStream = "event: message_start\n" +
		"data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n" +
		"event: ping\ndata: {\"type\": \"ping\"}\n\n" +
		"event: content_block_delta\n" +
		"data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"é\"}}\n\n" +
		"event: message_delta\n" +
		"data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":20}}\n\n" +
		"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
)

var (
	openAIEvents = []string{
		`message {"id":"c1","choices":[{"delta":{"content":"Hi"}}],"usage":null}`,
		`message {"id":"c1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}`,
		`message [DONE]`,
	}
	anthropicEvents = []string{
		`message_start {"type":"message_start","message":{"id":"msg_1","usage":{"input_tokens":10,"output_tokens":1}}}`,
		`ping {"type": "ping"}`,
		`content_block_delta {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"é"}}`,
		`message_delta {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":20}}`,
		`message_stop {"type":"message_stop"}`,
	}
)

var eventsTests = []struct {
	name   string
	stream string
	max    int
	close  bool     // Close after the stream
	want   []string // each event's type, a space, and its data
}{
	{"openai", openAIStream, 0, false, openAIEvents},
	{"anthropic", anthropicStream, 0, false, anthropicEvents},
	{"crlf", strings.ReplaceAll(anthropicStream, "\n", "\r\n"), 0, false, anthropicEvents},
	{"cr", strings.ReplaceAll(anthropicStream, "\n", "\r"), 0, false, anthropicEvents},
	{"mixed line endings", "event: a\rdata: 1\r\n\ndata: 2\n\r\r\n", 0, false, []string{"a 1", "message 2"}},
	{"comments", ": keep-alive\n\n:ping\ndata: x\n: more\n\n", 0, false, []string{"message x"}},
	{"multi-line data", "data: a\ndata:b\ndata:  c\ndata\n\n", 0, false, []string{"message a\nb\n c\n"}},
	{"empty data", "data:\n\ndata\n\n", 0, false, []string{"message ", "message "}},
	{"no data", "event: ping\n\ndata: x\n\n", 0, false, []string{"message x"}},
	{"empty type", "event: a\nevent:\ndata: x\n\n", 0, false, []string{"message x"}},
	{"last type", "event: a\nevent: b\ndata: x\n\n", 0, false, []string{"b x"}},
	{"ignored fields", "id: 1\nretry: 100\nfoo: bar\nData: no\nevents: no\ndata: x\n\n", 0, false, []string{"message x"}},
	{"colon in the value", "data: a: b\n\n", 0, false, []string{"message a: b"}},
	{"no final blank line", "data: x\n\ndata: y\n", 0, false, []string{"message x"}},
	{"close after a line", "data: x\n\ndata: y\n", 0, true, []string{"message x", "message y"}},
	{"close in a line", "event: message_stop\ndata: {\"type\":\"message_stop\"}", 0, true, []string{`message_stop {"type":"message_stop"}`}},
	{"close after the blank line", "data: x\n\n", 0, true, []string{"message x"}},
	{"close after a cr", "data: x\r", 0, true, []string{"message x"}},
	{"exactly max", "data: 0123456789\n\n", 10, false, []string{"message 0123456789"}},
	{"exactly max, lines", "data: 0123\ndata: 45678\n\n", 10, false, []string{"message 0123\n45678"}},
	{"over max", "data: 0123456789a\n\ndata: ok\n\n", 10, false, []string{"message ok"}},
	{"over max, lines", "event: a\ndata: 01234\ndata: 56789\ndata: x\n\ndata: ok\n\n", 10, false, []string{"message ok"}},
	{"over max, newline", "data: 0123456789\ndata\n\ndata: ok\n\n", 10, false, []string{"message ok"}},
	{"over max, closed", "data: ok\n\ndata: 0123456789a", 10, true, []string{"message ok"}},
	{"long type", "event: " + strings.Repeat("t", maxType+1) + "\ndata: x\n\ndata: ok\n\n", 0, false, []string{"message ok"}},
}

func TestEvents(t *testing.T) {
	for _, tc := range eventsTests {
		t.Run(tc.name, func(t *testing.T) {
			for _, chunks := range splits(tc.stream) {
				var got []string
				e := &Events{Max: tc.max, On: func(event string, data []byte) {
					got = append(got, event+" "+string(data))
				}}
				for _, c := range chunks {
					if n, err := e.Write([]byte(c)); n != len(c) || err != nil {
						t.Fatalf("Write(%q) = %d, %v", c, n, err)
					}
				}
				if tc.close {
					e.Close()
				}
				if !slices.Equal(got, tc.want) {
					t.Fatalf("%s: events %q, want %q", fed(chunks), got, tc.want)
				}
			}
		})
	}
}

// An event far longer than Max is not kept, its bytes or their room, and
// the event after it is still delivered.
func TestEventsBounded(t *testing.T) {
	var got []string
	e := &Events{Max: 100, On: func(event string, data []byte) {
		got = append(got, fmt.Sprintf("%s %d", event, len(data)))
	}}
	e.Write([]byte("event: big\ndata: "))
	chunk := []byte(strings.Repeat("x", 1000))
	for range 1000 {
		e.Write(chunk)
	}
	e.Write([]byte("\n\nevent: small\ndata: 0123456789\n\n"))
	if want := []string{"small 10"}; !slices.Equal(got, want) {
		t.Fatalf("events %q, want %q", got, want)
	}
	if cap(e.data) > 2*(100+1) {
		t.Fatalf("kept room for %d bytes of events of at most 100", cap(e.data))
	}
}

func FuzzEvents(f *testing.F) {
	for _, tc := range eventsTests {
		f.Add(tc.stream)
	}
	f.Fuzz(func(t *testing.T, stream string) {
		var whole, bytes []string
		w := &Events{Max: 64, On: func(event string, data []byte) { whole = append(whole, event+" "+string(data)) }}
		w.Write([]byte(stream))
		w.Close()
		b := &Events{Max: 64, On: func(event string, data []byte) { bytes = append(bytes, event+" "+string(data)) }}
		for i := range len(stream) {
			b.Write([]byte{stream[i]})
		}
		b.Close()
		if !slices.Equal(whole, bytes) {
			t.Fatalf("whole: %q; one byte at a time: %q", whole, bytes)
		}
	})
}
