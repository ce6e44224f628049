package main

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/sharedquota/quota/internal/store"
)

// How quotactl prints a bucket's name, and reads one back.
//
// It prints a name as one shell word that bash, zsh and ksh (and a POSIX
// shell since 2024) read back as the name, on one line, with nothing a
// terminal acts on:
//
//   - bare when it is made of letters, digits and - _ . / : @ % + = ,
//     only: api.example.com
//   - else in single quotes when every character is printable: 'my
//     bucket', 'it'\''s'
//   - else in $'...', with \n, \t, \r, \\, \' and each other byte of a
//     control character, of an invisible rune or of invalid UTF-8 as \ooo
//     in octal: $'line\nbreak'
//
// A NAME argument in that form, as a script that reads list's lines
// passes it without a shell, is read as the name it quotes: an argument
// that begins with ' or $' and is a whole word of quoted parts, bare safe
// characters and backslashed characters. Any other argument is the name
// itself.

// safeByte reports whether c stands for itself in a shell word.
func safeByte(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("-_./:@%+=,", c) >= 0
}

// quoteName returns name as quotactl prints it.
func quoteName(name string) string {
	bare, printable := name != "", utf8.ValidString(name)
	for i := 0; i < len(name); i++ {
		bare = bare && safeByte(name[i])
	}
	if bare {
		return name
	}
	for _, r := range name {
		printable = printable && strconv.IsPrint(r)
	}
	if printable {
		return "'" + strings.ReplaceAll(name, "'", `'\''`) + "'"
	}
	var b strings.Builder
	b.WriteString("$'")
	for i := 0; i < len(name); {
		r, n := utf8.DecodeRuneInString(name[i:])
		switch {
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\\' || r == '\'':
			b.WriteString(`\` + string(r))
		case r != utf8.RuneError && strconv.IsPrint(r) || r == utf8.RuneError && n > 1:
			b.WriteString(name[i : i+n])
		default:
			for _, c := range []byte(name[i : i+n]) {
				fmt.Fprintf(&b, `\%03o`, c)
			}
		}
		i += n
	}
	b.WriteString("'")
	return b.String()
}

// shellLine writes a command line a shell reads back as args, each quoted
// as quoteName quotes a name.
func shellLine(args ...string) string {
	quoted := make([]string, len(args))
	for i, a := range args {
		quoted[i] = quoteName(a)
	}
	return strings.Join(quoted, " ")
}

// unquoteName returns the name that arg, a NAME argument, stands for: the
// name it quotes when it is in the form quoteName prints (see above),
// else arg itself.
func unquoteName(arg string) string {
	if !strings.HasPrefix(arg, "'") && !strings.HasPrefix(arg, "$'") {
		return arg
	}
	var b strings.Builder
	for i := 0; i < len(arg); {
		switch {
		case arg[i] == '\'':
			j := strings.IndexByte(arg[i+1:], '\'')
			if j < 0 {
				return arg
			}
			b.WriteString(arg[i+1 : i+1+j])
			i += j + 2
		case strings.HasPrefix(arg[i:], "$'"):
			n, ok := ansiC(&b, arg[i+2:])
			if !ok {
				return arg
			}
			i += 2 + n
		case arg[i] == '\\' && i+1 < len(arg) && arg[i+1] != '\n':
			b.WriteByte(arg[i+1])
			i += 2
		case safeByte(arg[i]):
			b.WriteByte(arg[i])
			i++
		default:
			return arg
		}
	}
	return b.String()
}

// ansiCEscapes are the escapes of $'...' that stand for one byte.
var ansiCEscapes = map[byte]byte{
	'n': '\n', 't': '\t', 'r': '\r', 'a': '\a', 'b': '\b', 'e': 0x1b, 'E': 0x1b, 'f': '\f', 'v': '\v',
	'\\': '\\', '\'': '\'', '"': '"', '?': '?',
}

// ansiC writes to b what s, the inside of a $'...' and what follows it,
// stands for, up to the closing quote, and returns how many bytes of s it
// read, the quote included; false when s is not such a string, or uses
// an escape that quoteName does not print other than \xHH (\u, \U, \c).
func ansiC(b *strings.Builder, s string) (int, bool) {
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == '\'':
			return i + 1, true
		case c != '\\':
			b.WriteByte(c)
			i++
		case i+1 >= len(s):
			return 0, false
		case ansiCEscapes[s[i+1]] != 0:
			b.WriteByte(ansiCEscapes[s[i+1]])
			i += 2
		case '0' <= s[i+1] && s[i+1] <= '7':
			v, j := 0, i+1
			for ; j < len(s) && j < i+4 && '0' <= s[j] && s[j] <= '7'; j++ {
				v = v*8 + int(s[j]-'0')
			}
			b.WriteByte(byte(v)) // bash too keeps the low byte of \400 and above
			i = j
		case s[i+1] == 'x' && i+2 < len(s) && hexDigit(s[i+2]) >= 0:
			v, j := 0, i+2
			for ; j < len(s) && j < i+4 && hexDigit(s[j]) >= 0; j++ {
				v = v*16 + hexDigit(s[j])
			}
			b.WriteByte(byte(v))
			i = j
		default:
			return 0, false
		}
	}
	return 0, false
}

// hexDigit returns the value of the hex digit c, or -1.
func hexDigit(c byte) int {
	switch {
	case '0' <= c && c <= '9':
		return int(c - '0')
	case 'a' <= c && c <= 'f':
		return int(c-'a') + 10
	case 'A' <= c && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}

// isShortened reports whether name has the form in which Redis keeps a
// name over store.MaxNameLen bytes, and list prints it: its first bytes,
// "~" and a digest in lowercase hex, one byte over the bound. That form
// does not reach the bucket list showed: the package would take it for a
// name of its own, too long, and shorten it again, to another key.
func isShortened(name string) bool {
	if len(name) != store.MaxNameLen+1 || name[store.MaxNameLen-store.DigestLen] != '~' {
		return false
	}
	for _, c := range []byte(name[store.MaxNameLen-store.DigestLen+1:]) {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}
