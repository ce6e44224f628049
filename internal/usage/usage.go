// Package usage reads how many tokens an LLM API response used from the
// response's body as the caller reads it: a Field finds the "usage" member
// of a JSON body, and Events splits a server-sent-event stream into the
// events whose data holds it. Both take the bytes through Write, in chunks
// that may split anywhere, and keep only what they look for, so that a
// large body is never buffered whole. Extra works out what a settle with
// the usage takes or gives back of a request's reservation, and Lower and
// Lows what the provider says remains of its meters, and holds by then.
package usage

import "bytes"

// Field finds the value of one top-level field of a JSON object in a
// stream of bytes, keeping only that value's bytes (at most Max).
type Field struct {
	name string
	max  int

	at    place  // where in the outermost object the scan is
	same  int    // how many first bytes of the current key are name's; -1 once one differs
	depth int    // brackets open in the current value
	str   bool   // inside a string of the current value
	esc   bool   // the last byte was a backslash inside a string
	match bool   // the current value is the field's, its bytes kept in val
	over  bool   // the current value is longer than max, its bytes dropped
	val   []byte // the field's value, complete when ok
	ok    bool   // val holds a complete value, other than null
}

// A place is where in the outermost object a Field's scan is.
type place int

const (
	start     place = iota // before the object's "{"
	key                    // where a key or the closing "}" is due
	inKey                  // inside a key
	colon                  // after a key, where its ":" is due
	value                  // after the ":", where the value is due
	scalar                 // inside a number, true, false or null
	scalarEnd              // in the whitespace after a scalar
	nested                 // inside a string, an object or an array
	after                  // after a value, where a "," or the closing "}" is due
	end                    // after the object, or at input it cannot read: nothing more is looked at
)

// NewField returns a Field that looks for the top-level key name (compared
// with the key's raw bytes between its quotes) and keeps a value of at most
// max bytes; a longer value is dropped (Value then reports false unless a
// later occurrence fits).
func NewField(name string, max int) *Field {
	return &Field{name: name, max: max}
}

// Write scans p; it never fails and always returns len(p), nil.
func (f *Field) Write(p []byte) (int, error) {
	for _, c := range p {
		f.scan(c)
	}
	return len(p), nil
}

// scan moves the scan on by one byte of the object.
func (f *Field) scan(c byte) {
	switch f.at {
	case start:
		switch {
		case c == '{':
			f.at = key
		case !space(c):
			f.at = end // not an object
		}
	case key:
		switch {
		case c == '"':
			f.at, f.same = inKey, 0
		case c == '}': // an empty object, or a "," before the "}"
			f.at = end
		case !space(c):
			f.at = end
		}
	case inKey:
		switch {
		case f.esc:
			f.esc = false
		case c == '\\':
			f.esc = true
		case c == '"':
			f.at, f.match = colon, f.same == len(f.name)
			return
		}
		// The key's raw bytes, escapes as written, are compared with name.
		if f.same >= 0 && f.same < len(f.name) && f.name[f.same] == c {
			f.same++
		} else {
			f.same = -1
		}
	case colon:
		switch {
		case c == ':':
			f.at = value
		case !space(c):
			f.at, f.match = end, false
		}
	case value:
		if space(c) {
			return
		}
		if f.match {
			f.val, f.over, f.ok = f.val[:0], false, false
		}
		switch c {
		case '"':
			f.at, f.str = nested, true
		case '{', '[':
			f.at, f.depth = nested, 1
		case ',', '}', ']', ':':
			f.at, f.match = end, false // no value
			return
		default:
			f.at = scalar
		}
		f.keep(c)
	case scalar, scalarEnd:
		switch {
		case c == ',':
			f.done()
			f.at = key
		case c == '}':
			f.done()
			f.at = end
		case space(c):
			f.at = scalarEnd
		case f.at == scalarEnd: // two scalars in a row
			f.at, f.match = end, false
		default:
			f.keep(c)
		}
	case nested:
		f.keep(c)
		switch {
		case f.str && f.esc:
			f.esc = false
		case f.str && c == '\\':
			f.esc = true
		case c == '"':
			f.str = !f.str
		case f.str:
		case c == '{' || c == '[':
			f.depth++
		case c == '}' || c == ']':
			f.depth--
		}
		if !f.str && f.depth == 0 {
			f.done()
			f.at = after
		}
	case after:
		switch {
		case c == ',':
			f.at = key
		case !space(c): // the closing "}", or input it cannot read
			f.at = end
		}
	}
}

// keep adds c to the field's value, or drops the value once it is longer
// than max.
func (f *Field) keep(c byte) {
	if !f.match || f.over {
		return
	}
	if len(f.val) >= f.max {
		f.val, f.over = f.val[:0], true
		return
	}
	f.val = append(f.val, c)
}

// done ends the current value: the field's, unless too long or null,
// becomes the one Value reports.
func (f *Field) done() {
	if f.match {
		f.ok = !f.over && string(f.val) != "null"
		f.match = false
	}
}

// Value returns the raw JSON bytes of the last complete occurrence of the
// field at the top level of the object, and true; false when none was seen,
// or the value was JSON null.
func (f *Field) Value() ([]byte, bool) {
	if !f.ok {
		return nil, false
	}
	return bytes.Clone(f.val), true
}

// Reset forgets everything seen, to scan a new object.
func (f *Field) Reset() {
	*f = Field{name: f.name, max: f.max, val: f.val[:0]}
}

// space reports whether c is whitespace in JSON.
func space(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r'
}

// Events splits a server-sent-event stream (the text/event-stream format of
// the WHATWG HTML spec) into events as its bytes stream by, and calls On
// with each event's type and data when the event is dispatched.
type Events struct {
	On  func(event string, data []byte) // data without its final newline; valid only during the call
	Max int                             // longest event data kept, bytes; 0 means 1 MiB; a longer event is skipped whole

	part  part   // which part of a line the scan is in
	name  []byte // the line's field name, cut after len("event")+1 bytes: longer names are unknown
	field field  // the field whose value the line holds
	cr    bool   // the last byte was a "\r": a "\n" right after it ends no second line
	typ   []byte // the event's type; empty for "message"
	data  []byte // the event's data, each line followed by "\n"
	skip  bool   // the event is too long: it is dropped when dispatched
}

// A part is which part of a line an Events' scan is in.
type part int

const (
	lineStart part = iota // where a line starts: a line ending here is a blank line
	inName                // in the field name
	colonSeen             // right after the ":", where a space is dropped
	inValue               // in the field's value
)

// A field is a field of an event that Events keeps.
type field int

const (
	otherField field = iota // a comment, "id", "retry" or an unknown field: ignored
	dataField
	eventField
)

const (
	defaultMax = 1 << 20 // Events.Max when 0
	maxType    = 256     // longest event type kept, bytes; a longer one skips its event
)

// Write scans p; it never fails and always returns len(p), nil.
func (e *Events) Write(p []byte) (int, error) {
	for _, c := range p {
		cr := e.cr
		e.cr = c == '\r'
		switch {
		case c == '\n' && cr: // the second byte of a "\r\n"
		case c == '\n' || c == '\r':
			e.endLine()
		case e.part == lineStart || e.part == inName:
			if c == ':' {
				e.field, e.part = named(e.name), colonSeen
				if e.field == eventField {
					e.typ = e.typ[:0]
				}
				break
			}
			e.part = inName
			if len(e.name) <= len("event") {
				e.name = append(e.name, c)
			}
		case e.part == colonSeen && c == ' ':
			e.part = inValue
		default:
			e.part = inValue
			e.add(c)
		}
	}
	return len(p), nil
}

// named returns the field a line's field name names.
func named(name []byte) field {
	switch string(name) {
	case "data":
		return dataField
	case "event":
		return eventField
	}
	return otherField
}

// add adds c to the value of the line's field, or skips the event once
// that is too long.
func (e *Events) add(c byte) {
	switch {
	case e.skip:
	case e.field == dataField && len(e.data) < e.max():
		e.data = append(e.data, c)
	case e.field == eventField && len(e.typ) < maxType:
		e.typ = append(e.typ, c)
	case e.field != otherField:
		e.skip, e.data, e.typ = true, e.data[:0], e.typ[:0]
	}
}

// endLine ends a line: a blank one dispatches the event, a data line adds
// its newline to the data.
func (e *Events) endLine() {
	switch e.part {
	case lineStart:
		e.dispatch()
		return
	case inName: // a field without a colon: its value is empty
		e.field = named(e.name)
		if e.field == eventField {
			e.typ = e.typ[:0]
		}
	}
	if e.field == dataField && !e.skip {
		// The newline may be the final one, removed at dispatch, so the
		// data reaches max + 1 bytes before it is too long.
		if len(e.data) > e.max() {
			e.skip, e.data, e.typ = true, e.data[:0], e.typ[:0]
		} else {
			e.data = append(e.data, '\n')
		}
	}
	e.part, e.name, e.field = lineStart, e.name[:0], otherField
}

// dispatch calls On with the event, if it has data and fits, and starts
// the next event.
func (e *Events) dispatch() {
	if !e.skip && len(e.data) > 0 && e.On != nil {
		typ := "message"
		if len(e.typ) > 0 {
			typ = string(e.typ)
		}
		e.On(typ, e.data[:len(e.data)-1])
	}
	e.typ, e.data, e.skip = e.typ[:0], e.data[:0], false
}

// max returns the longest event data kept.
func (e *Events) max() int {
	if e.Max <= 0 {
		return defaultMax
	}
	return e.Max
}

// Close dispatches an event left without its final blank line (a stream cut
// at its end), as the stream's end.
func (e *Events) Close() {
	if e.part != lineStart {
		e.endLine()
	}
	e.dispatch()
	e.cr = false
}
