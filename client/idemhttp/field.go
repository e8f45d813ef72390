package idemhttp

import (
	"errors"
	"strings"
)

// parseKey parses the Idempotency-Key field lines of a request: one
// Structured Field Item (RFC 9651, section 4.2) whose bare item is a String
// (section 2.1 of the draft). Parameters are parsed and ignored, as RFC
// 9651 asks of parameters a recipient does not know. Several field lines
// are combined with a comma, as for any field, and so are refused: an Item
// is never a list. With bareTokens, an unquoted sf-token (Idempotency-Key:
// abc-123, as many clients written for Stripe send it) is taken too.
func parseKey(lines []string, bareTokens bool) (string, error) {
	p := &sfParser{s: strings.Join(lines, ", ")}
	p.skipSP()
	var key string
	switch {
	case p.peek() == '"':
		s, err := p.str()
		if err != nil {
			return "", err
		}
		key = s
	case bareTokens && isTokenStart(p.peek()):
		key = p.token()
	case p.eof():
		return "", errors.New("the field is empty")
	default:
		return "", errors.New(`the value must be a Structured Field String, in double quotes: Idempotency-Key: "…"`)
	}
	if err := p.params(); err != nil {
		return "", err
	}
	p.skipSP()
	if !p.eof() {
		if p.peek() == ',' {
			return "", errors.New("the field is given more than once (or is a list): the request must carry one key")
		}
		return "", errors.New("unexpected characters after the key")
	}
	return key, nil
}

type sfParser struct {
	s string
	i int
}

func (p *sfParser) eof() bool { return p.i >= len(p.s) }

func (p *sfParser) peek() byte {
	if p.eof() {
		return 0
	}
	return p.s[p.i]
}

func (p *sfParser) skipSP() {
	for !p.eof() && p.s[p.i] == ' ' {
		p.i++
	}
}

// str parses an sf-string: DQUOTE *( unescaped / "\" ( DQUOTE / "\" ) )
// DQUOTE, where unescaped is printable ASCII but DQUOTE and "\".
func (p *sfParser) str() (string, error) {
	p.i++ // the opening quote
	var b strings.Builder
	for !p.eof() {
		c := p.s[p.i]
		p.i++
		switch {
		case c == '\\':
			if p.eof() || (p.s[p.i] != '"' && p.s[p.i] != '\\') {
				return "", errors.New(`a backslash in the string escapes only " and \`)
			}
			b.WriteByte(p.s[p.i])
			p.i++
		case c == '"':
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", errors.New("the string may hold printable ASCII only")
		default:
			b.WriteByte(c)
		}
	}
	return "", errors.New("the string has no closing double quote")
}

func isTokenStart(c byte) bool { return c == '*' || ('a' <= c && c <= 'z') || ('A' <= c && c <= 'Z') }

// isTokenChar is tchar (RFC 9110) plus ":" and "/".
func isTokenChar(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~:/", c) >= 0
}

func (p *sfParser) token() string {
	start := p.i
	p.i++
	for !p.eof() && isTokenChar(p.s[p.i]) {
		p.i++
	}
	return p.s[start:p.i]
}

// params parses and drops parameters: *( ";" *SP key [ "=" bare-item ] ).
func (p *sfParser) params() error {
	for p.peek() == ';' {
		p.i++
		p.skipSP()
		c := p.peek()
		if !(c == '*' || ('a' <= c && c <= 'z')) {
			return errors.New("a parameter's name must start with a lowercase letter or *")
		}
		for !p.eof() {
			c := p.s[p.i]
			if !(('a' <= c && c <= 'z') || ('0' <= c && c <= '9') || strings.IndexByte("_-.*", c) >= 0) {
				break
			}
			p.i++
		}
		if p.peek() == '=' {
			p.i++
			if err := p.bareItem(); err != nil {
				return err
			}
		}
	}
	return nil
}

// bareItem parses a parameter's value: an Integer or Decimal, a String, a
// Token, a Byte Sequence, a Boolean, a Date or a Display String.
func (p *sfParser) bareItem() error {
	c := p.peek()
	switch {
	case c == '-' || ('0' <= c && c <= '9'):
		if c == '-' {
			p.i++
		}
		return p.number()
	case c == '"':
		_, err := p.str()
		return err
	case isTokenStart(c):
		p.token()
		return nil
	case c == ':':
		p.i++
		for !p.eof() && p.s[p.i] != ':' {
			c := p.s[p.i]
			if !(('a' <= c && c <= 'z') || ('A' <= c && c <= 'Z') || ('0' <= c && c <= '9') || c == '+' || c == '/' || c == '=') {
				return errors.New("a byte sequence parameter holds base64 only")
			}
			p.i++
		}
		if p.eof() {
			return errors.New("a byte sequence parameter has no closing colon")
		}
		p.i++
		return nil
	case c == '?':
		p.i++
		if p.peek() != '0' && p.peek() != '1' {
			return errors.New("a boolean parameter is ?0 or ?1")
		}
		p.i++
		return nil
	case c == '@':
		p.i++
		if p.peek() == '-' {
			p.i++
		}
		return p.number()
	case c == '%':
		p.i++
		if p.peek() != '"' {
			return errors.New(`a display string parameter is %"…"`)
		}
		_, err := p.str()
		return err
	}
	return errors.New("a parameter's value is not a Structured Field bare item")
}

func (p *sfParser) number() error {
	start := p.i
	for !p.eof() && (('0' <= p.s[p.i] && p.s[p.i] <= '9') || p.s[p.i] == '.') {
		p.i++
	}
	if p.i == start {
		return errors.New("a numeric parameter has no digits")
	}
	return nil
}
