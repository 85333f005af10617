package gcp

import (
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
)

// checkServiceAccountKey checks that data is a service-account key file
// the auth library can sign with. Its errors never quote the file.
func checkServiceAccountKey(data []byte) error {
	var key struct {
		Type        string `json:"type"`
		ClientEmail string `json:"client_email"`
		PrivateKey  string `json:"private_key"`
		TokenURI    string `json:"token_uri"`
	}
	if err := json.Unmarshal(data, &key); err != nil {
		var se *json.SyntaxError
		if errors.As(err, &se) {
			return fmt.Errorf("not JSON (syntax error at byte %d)", se.Offset)
		}
		return errors.New("not a JSON object with string fields")
	}
	switch {
	case key.Type != "service_account":
		return fmt.Errorf("type is %q, want service_account", key.Type)
	case key.ClientEmail == "":
		return errors.New("client_email is missing")
	case key.PrivateKey == "":
		return errors.New("private_key is missing")
	}
	block, _ := pem.Decode([]byte(key.PrivateKey))
	if block == nil {
		return errors.New("private_key is not PEM")
	}
	if _, err := x509.ParsePKCS8PrivateKey(block.Bytes); err != nil {
		if _, err1 := x509.ParsePKCS1PrivateKey(block.Bytes); err1 != nil {
			return errors.New("private_key is not a PKCS#8 or PKCS#1 key")
		}
	}
	return nil
}
