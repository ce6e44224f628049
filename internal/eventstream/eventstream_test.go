package eventstream

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"hash/crc32"
	"maps"
	"testing"
)

// read feeds stream to a Reader in chunks of size bytes and returns the
// messages it handed on.
func read(stream []byte, size, max int) ([]Message, error) {
	var got []Message
	r := &Reader{Max: max, On: func(m Message) {
		got = append(got, Message{Headers: m.Headers, Payload: bytes.Clone(m.Payload)})
	}}
	for b := stream; len(b) > 0; {
		n := min(size, len(b))
		r.Write(b[:n])
		b = b[n:]
	}
	return got, r.Err()
}

// The messages of a stream come out whole, whatever the chunks its bytes
// arrive in.
func TestReaderSplitsMessages(t *testing.T) {
	var stream []byte
	var want []Message
	for i, ev := range []string{"messageStart", "contentBlockDelta", "messageStop", "metadata"} {
		h := [][2]string{{":event-type", ev}, {":content-type", "application/json"}, {":message-type", "event"}}
		p := []byte(fmt.Sprintf(`{"n":%d}`, i))
		stream = append(stream, Encode(h, p)...)
		want = append(want, Message{Headers: map[string]string{":event-type": ev, ":content-type": "application/json", ":message-type": "event"}, Payload: p})
	}
	stream = append(stream, Encode(nil, nil)...) // no headers, no payload
	want = append(want, Message{Headers: map[string]string{}, Payload: []byte{}})
	for _, size := range []int{1, 3, 7, 12, 16, len(stream)} {
		got, err := read(stream, size, 0)
		if err != nil {
			t.Fatalf("chunks of %d: %v", size, err)
		}
		if len(got) != len(want) {
			t.Fatalf("chunks of %d: %d messages, want %d", size, len(got), len(want))
		}
		for i := range want {
			if !maps.Equal(got[i].Headers, want[i].Headers) || !bytes.Equal(got[i].Payload, want[i].Payload) {
				t.Errorf("chunks of %d: message %d = %v %q, want %v %q", size, i, got[i].Headers, got[i].Payload, want[i].Headers, want[i].Payload)
			}
		}
	}
}

// A message with headers of every type of the encoding: only those with
// string values are kept, and the others are read past.
func TestReaderReadsHeaderTypes(t *testing.T) {
	var hs []byte
	add := func(name string, typ byte, value []byte) {
		hs = append(hs, byte(len(name)))
		hs = append(hs, name...)
		hs = append(hs, typ)
		hs = append(hs, value...)
	}
	add("t", typeTrue, nil)
	add("f", typeFalse, nil)
	add("b", typeByte, []byte{7})
	add("s", typeShort, []byte{0, 7})
	add("i", typeInt, []byte{0, 0, 0, 7})
	add("l", typeLong, make([]byte, 8))
	add("raw", typeBytes, []byte{0, 2, 0xff, 0xfe})
	add("ts", typeTimestamp, make([]byte, 8))
	add("id", typeUUID, make([]byte, 16))
	add(":event-type", typeString, append([]byte{0, 8}, "metadata"...))
	m := frame(hs, []byte(`{}`))
	got, err := read(m, 5, 0)
	if err != nil || len(got) != 1 {
		t.Fatalf("%d messages, %v; want 1", len(got), err)
	}
	if want := map[string]string{":event-type": "metadata"}; !maps.Equal(got[0].Headers, want) {
		t.Errorf("headers %v, want %v", got[0].Headers, want)
	}
}

// frame returns the message of raw headers hs and payload p.
func frame(hs, p []byte) []byte {
	total := minLen + len(hs) + len(p)
	m := binary.BigEndian.AppendUint32(nil, uint32(total))
	m = binary.BigEndian.AppendUint32(m, uint32(len(hs)))
	m = binary.BigEndian.AppendUint32(m, crc32.ChecksumIEEE(m))
	m = append(append(m, hs...), p...)
	return binary.BigEndian.AppendUint32(m, crc32.ChecksumIEEE(m))
}

// Encode writes the encoding's reference message: the empty message of
// the AWS SDKs' test vectors (0x00000010 total, 0 headers, its CRCs).
func TestEncodeEmpty(t *testing.T) {
	if got, want := hex.EncodeToString(Encode(nil, nil)), "000000100000000005c248eb7d98c8ff"; got != want {
		t.Errorf("the empty message %s, want %s", got, want)
	}
}

// A message longer than Max is skipped whole, and the ones around it read.
func TestReaderSkipsLongMessages(t *testing.T) {
	long := Encode([][2]string{{":event-type", "contentBlockDelta"}}, bytes.Repeat([]byte("x"), 500))
	short := Encode([][2]string{{":event-type", "metadata"}}, []byte(`{"usage":{}}`))
	stream := append(append(append([]byte{}, short...), long...), short...)
	got, err := read(stream, 9, 100)
	if err != nil || len(got) != 2 {
		t.Fatalf("%d messages, %v; want the 2 short ones", len(got), err)
	}
}

// A stream whose bytes are damaged stops, and says why: its framing is lost.
func TestReaderStopsAtDamage(t *testing.T) {
	good := Encode([][2]string{{":event-type", "metadata"}}, []byte(`{"usage":{}}`))
	for name, damage := range map[string]func([]byte){
		"prelude CRC": func(b []byte) { b[9] ^= 1 },
		"total":       func(b []byte) { b[3] ^= 1 }, // the prelude's CRC catches it
		"payload":     func(b []byte) { b[len(b)-6] ^= 1 },
		"message CRC": func(b []byte) { b[len(b)-1] ^= 1 },
	} {
		bad := bytes.Clone(good)
		damage(bad)
		got, err := read(append(append(bad, good...), good...), 4, 0)
		if err == nil || len(got) != 0 {
			t.Errorf("%s damaged: %d messages, error %v; want none, and an error", name, len(got), err)
		}
	}
	// Headers that run past their length, with the CRCs right.
	bad := frame([]byte{5, 'a', 'b'}, nil)
	if got, err := read(bad, 3, 0); err == nil || len(got) != 0 {
		t.Errorf("headers cut short: %d messages, error %v; want none, and an error", len(got), err)
	}
	// A total too short to hold a prelude and a CRC.
	short := binary.BigEndian.AppendUint32(nil, 8)
	short = binary.BigEndian.AppendUint32(short, 0)
	short = binary.BigEndian.AppendUint32(short, crc32.ChecksumIEEE(short))
	if _, err := read(short, 12, 0); err == nil {
		t.Error("a total of 8 bytes read without an error")
	}
}
