// Package eventstream reads and writes the messages of the AWS event
// stream encoding (application/vnd.amazon.eventstream), in which Amazon
// Bedrock streams the events of ConverseStream. A message is a prelude
// (its total length and the length of its headers, 4 bytes each, big
// endian, and the CRC-32 of those 8 bytes), its headers, its payload, and
// the CRC-32 of everything before it. A Reader takes a stream's bytes
// through Write, in chunks that may split anywhere, and hands on each
// message whole; Encode writes one.
package eventstream

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
)

// A Message is one message of an event stream: its headers whose values
// are strings (":event-type", ":message-type", ...), and its payload.
type Message struct {
	Headers map[string]string
	Payload []byte
}

const (
	preludeLen = 12 // total length, headers length, prelude CRC
	crcLen     = 4  // the message CRC
	minLen     = preludeLen + crcLen
	defaultMax = 1 << 20
)

// The types of header values, by their byte in the encoding.
const (
	typeTrue = iota
	typeFalse
	typeByte
	typeShort
	typeInt
	typeLong
	typeBytes
	typeString
	typeTimestamp
	typeUUID
)

// Encode returns the message of headers, each a name and a string value
// in the order given, and payload. It panics if a name is longer than 255
// bytes or a value longer than 65,535: the encoding cannot say them.
func Encode(headers [][2]string, payload []byte) []byte {
	var hs []byte
	for _, h := range headers {
		name, value := h[0], h[1]
		if len(name) > 255 || len(value) > 65535 {
			panic(fmt.Sprintf("eventstream: header %q of %d bytes is too long to encode", name, len(value)))
		}
		hs = append(hs, byte(len(name)))
		hs = append(hs, name...)
		hs = append(hs, typeString)
		hs = binary.BigEndian.AppendUint16(hs, uint16(len(value)))
		hs = append(hs, value...)
	}
	total := minLen + len(hs) + len(payload)
	m := make([]byte, 0, total)
	m = binary.BigEndian.AppendUint32(m, uint32(total))
	m = binary.BigEndian.AppendUint32(m, uint32(len(hs)))
	m = binary.BigEndian.AppendUint32(m, crc32.ChecksumIEEE(m))
	m = append(m, hs...)
	m = append(m, payload...)
	return binary.BigEndian.AppendUint32(m, crc32.ChecksumIEEE(m))
}

// A Reader splits an event stream into its messages as its bytes stream
// by, and calls On with each message whose CRCs match. A message longer
// than Max is skipped whole, unread. Once the stream is broken (a prelude
// whose CRC does not match, a length it cannot hold, a message whose CRC
// does not match, headers it cannot read) the Reader reads nothing more,
// and Err says why: its framing is lost.
type Reader struct {
	On  func(Message) // called with each message; its Payload is valid only during the call
	Max int           // longest message kept, bytes; 0 means 1 MiB

	buf  []byte // the bytes of the message under way
	skip int    // bytes still to skip of a message longer than Max
	err  error
}

// Write scans p; it never fails and always returns len(p), nil.
func (r *Reader) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 && r.err == nil {
		if r.skip > 0 {
			k := min(r.skip, len(p))
			r.skip -= k
			p = p[k:]
			continue
		}
		need := preludeLen
		if len(r.buf) >= preludeLen {
			need = int(binary.BigEndian.Uint32(r.buf))
		}
		k := min(need-len(r.buf), len(p))
		r.buf = append(r.buf, p[:k]...)
		p = p[k:]
		switch {
		case len(r.buf) == preludeLen && need == preludeLen:
			r.prelude()
		case len(r.buf) == need:
			r.message()
		}
	}
	return n, nil
}

// prelude checks the prelude in r.buf, and starts skipping a message
// longer than Max.
func (r *Reader) prelude() {
	total := binary.BigEndian.Uint32(r.buf)
	headers := binary.BigEndian.Uint32(r.buf[4:])
	if crc32.ChecksumIEEE(r.buf[:8]) != binary.BigEndian.Uint32(r.buf[8:]) {
		r.err = errors.New("eventstream: the prelude's CRC does not match")
		return
	}
	if total < minLen || uint64(headers) > uint64(total)-minLen {
		r.err = fmt.Errorf("eventstream: a message of %d bytes cannot hold %d bytes of headers", total, headers)
		return
	}
	if max := r.max(); uint64(total) > uint64(max) {
		r.skip, r.buf = int(total)-preludeLen, r.buf[:0]
	}
}

// message checks the whole message in r.buf and hands it on.
func (r *Reader) message() {
	b := r.buf
	r.buf = r.buf[:0]
	end := len(b) - crcLen
	if crc32.ChecksumIEEE(b[:end]) != binary.BigEndian.Uint32(b[end:]) {
		r.err = errors.New("eventstream: the message's CRC does not match")
		return
	}
	hl := int(binary.BigEndian.Uint32(b[4:]))
	headers, err := readHeaders(b[preludeLen : preludeLen+hl])
	if err != nil {
		r.err = err
		return
	}
	if r.On != nil {
		r.On(Message{Headers: headers, Payload: b[preludeLen+hl : end]})
	}
}

// readHeaders reads the headers of a message, keeping those whose values
// are strings.
func readHeaders(b []byte) (map[string]string, error) {
	out := map[string]string{}
	short := errors.New("eventstream: a header runs past the message's headers")
	for len(b) > 0 {
		nl := int(b[0])
		if len(b) < 1+nl+1 {
			return nil, short
		}
		name, typ := string(b[1:1+nl]), b[1+nl]
		b = b[2+nl:]
		var size int
		switch typ {
		case typeTrue, typeFalse:
		case typeByte:
			size = 1
		case typeShort:
			size = 2
		case typeInt:
			size = 4
		case typeLong, typeTimestamp:
			size = 8
		case typeUUID:
			size = 16
		case typeBytes, typeString:
			if len(b) < 2 {
				return nil, short
			}
			size = int(binary.BigEndian.Uint16(b))
			b = b[2:]
		default:
			return nil, fmt.Errorf("eventstream: header %q has an unknown value type %d", name, typ)
		}
		if len(b) < size {
			return nil, short
		}
		if typ == typeString {
			out[name] = string(b[:size])
		}
		b = b[size:]
	}
	return out, nil
}

// max returns the longest message kept.
func (r *Reader) max() int {
	if r.Max <= 0 {
		return defaultMax
	}
	return r.Max
}

// Err returns why the stream could not be read, or nil.
func (r *Reader) Err() error { return r.err }
