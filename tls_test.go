package quota

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// TestTLS runs the Limiter over TLS to a redis-server with a throwaway
// certificate, and checks that a client that does not trust it gets no
// tokens.
func TestTLS(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	dir := t.TempDir()
	ca, caKey := newCert(t, nil, nil, "quota test CA")
	leaf, leafKey := newCert(t, ca, caKey, "127.0.0.1")
	writePEM(t, filepath.Join(dir, "ca.crt"), "CERTIFICATE", ca.Raw)
	writePEM(t, filepath.Join(dir, "redis.crt"), "CERTIFICATE", leaf.Raw)
	der, err := x509.MarshalECPrivateKey(leafKey)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, filepath.Join(dir, "redis.key"), "EC PRIVATE KEY", der)

	port := freePort(t)
	redistest.Start(t,
		"--tls-port", strconv.Itoa(port),
		"--tls-cert-file", filepath.Join(dir, "redis.crt"),
		"--tls-key-file", filepath.Join(dir, "redis.key"),
		"--tls-ca-cert-file", filepath.Join(dir, "ca.crt"),
		"--tls-auth-clients", "no")
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))

	pool := x509.NewCertPool()
	pool.AddCert(ca)
	o := limiterOptions(addr)
	o.TLSConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	rdb := redis.NewClient(o)
	defer rdb.Close()
	l := NewLimiter(rdb)
	ctx := context.Background()
	for range 3 {
		if err := l.Wait(ctx, "tls", PerSecond(10)); err != nil {
			t.Fatalf("Wait over TLS: %v", err)
		}
	}

	untrusting := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialerRetries: 1,
		TLSConfig: &tls.Config{MinVersion: tls.VersionTLS12}})
	defer untrusting.Close()
	err = NewLimiter(untrusting, WithLogger(discardLogger())).Wait(ctx, "tls", PerSecond(10))
	var verr *tls.CertificateVerificationError
	if !errors.Is(err, ErrUnavailable) || !errors.As(err, &verr) {
		t.Errorf("Wait with an untrusted certificate: err = %v, want ErrUnavailable carrying the verification error", err)
	}
}

// newCert makes a certificate for name, signed by parent, or a CA that
// signs itself when parent is nil.
func newCert(t *testing.T, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, name string) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
	}
	if parent == nil {
		tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
		tmpl.KeyUsage = x509.KeyUsageCertSign
		parent, parentKey = tmpl, key
	} else {
		tmpl.IPAddresses = []net.IP{net.ParseIP(name)}
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

func writePEM(t *testing.T, path, kind string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// freePort returns a loopback port that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
