package kvm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"strings"

	libvirt "github.com/digitalocean/go-libvirt"
	"golang.org/x/sync/singleflight"
	"libvirt.org/go/libvirtxml"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// imageSource is what placement.image resolved to: a key of images, or an
// http(s) URL given directly (Key empty).
type imageSource struct {
	Key string
	Image
}

// resolveImage maps placement.image to a source. Anything that is neither
// a configured key nor an http(s) URL is Permanent.
func (c Config) resolveImage(image string) (imageSource, error) {
	if img, ok := c.Images[image]; ok {
		return imageSource{Key: image, Image: img}, nil
	}
	if isHTTPURL(image) {
		return imageSource{Image: Image{URL: image}.withDefaults()}, nil
	}
	return imageSource{}, errclass.New(errclass.Permanent, "placement.image %q is neither a key of images nor an http(s) URL", image)
}

// volumeName is the cached base's volume: base-<key>.<format>, or for a
// direct URL base-<first 16 hex of its SHA-256>.<format>.
func (s imageSource) volumeName() string {
	key := s.Key
	if key == "" {
		sum := sha256.Sum256([]byte(s.URL))
		key = hex.EncodeToString(sum[:8])
	}
	return "base-" + key + "." + s.Format
}

// markerName is the volume holding the verified digest of the base. It is
// written only after the base's upload completed and verified, so a base
// without its marker is a partial upload and never used.
func (s imageSource) markerName() string { return s.volumeName() + ".sha256" }

// imageCache downloads each base once per host; concurrent callers for the
// same base on the same host share one download.
type imageCache struct {
	http   *http.Client
	flight singleflight.Group
}

func newImageCache(c *http.Client) *imageCache {
	if c == nil {
		c = http.DefaultClient
	}
	return &imageCache{http: c}
}

// ensure returns the path of src's base volume in pool on host, downloading
// and verifying it first when the pool has no complete, current copy.
func (ic *imageCache) ensure(ctx context.Context, api libvirtAPI, host string, pool libvirt.StoragePool, src imageSource) (string, error) {
	v, err, _ := ic.flight.Do(host+"/"+pool.Name+"/"+src.volumeName(), func() (any, error) {
		return ic.ensureOnce(ctx, api, pool, src)
	})
	if err != nil {
		return "", err
	}
	return v.(string), nil
}

func (ic *imageCache) ensureOnce(ctx context.Context, api libvirtAPI, pool libvirt.StoragePool, src imageSource) (string, error) {
	base, baseErr := api.StorageVolLookupByName(pool, src.volumeName())
	if baseErr != nil && !hasCode(baseErr, libvirt.ErrNoStorageVol) {
		return "", baseErr
	}
	if baseErr == nil {
		marker, err := readMarker(api, pool, src.markerName())
		if err != nil {
			return "", err
		}
		if marker != "" && (src.SHA256 == "" || marker == src.SHA256) {
			return api.StorageVolGetPath(base)
		}
	}
	// Missing, partial or of another checksum: start over.
	for _, name := range []string{src.markerName(), src.volumeName()} {
		if err := deleteVolume(api, pool, name); err != nil {
			return "", err
		}
	}
	return ic.download(ctx, api, pool, src)
}

// readMarker returns the digest in the marker volume, "" when there is none.
func readMarker(api libvirtAPI, pool libvirt.StoragePool, name string) (string, error) {
	vol, err := api.StorageVolLookupByName(pool, name)
	if hasCode(err, libvirt.ErrNoStorageVol) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	var buf bytes.Buffer
	if err := api.StorageVolDownload(vol, &buf, 0, sha256.Size*2, 0); err != nil {
		return "", err
	}
	return strings.TrimSpace(buf.String()), nil
}

func (ic *imageCache) download(ctx context.Context, api libvirtAPI, pool libvirt.StoragePool, src imageSource) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, src.URL, nil)
	if err != nil {
		return "", errclass.Wrap(errclass.Permanent, fmt.Errorf("image %s: %w", src.URL, err))
	}
	resp, err := ic.http.Do(req)
	if err != nil {
		return "", errclass.Wrap(errclass.Transient, fmt.Errorf("downloading image %s: %w", src.URL, err))
	}
	defer func() { _ = resp.Body.Close() }()
	switch {
	case resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusGone || resp.StatusCode == http.StatusForbidden:
		return "", errclass.New(errclass.Permanent, "downloading image %s: %s", src.URL, resp.Status)
	case resp.StatusCode != http.StatusOK:
		return "", errclass.New(errclass.Transient, "downloading image %s: %s", src.URL, resp.Status)
	case resp.ContentLength <= 0:
		// The volume is sized before the upload starts.
		return "", errclass.New(errclass.Permanent, "downloading image %s: the server sends no Content-Length", src.URL)
	}
	size := uint64(resp.ContentLength)
	vol, err := createVolume(api, pool, src.volumeName(), src.Format, size, nil)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	if err := api.StorageVolUpload(vol, io.TeeReader(resp.Body, h), 0, size, 0); err != nil {
		_ = api.StorageVolDelete(vol, 0)
		return "", err
	}
	got := hex.EncodeToString(h.Sum(nil))
	if src.SHA256 != "" && got != src.SHA256 {
		_ = api.StorageVolDelete(vol, 0)
		return "", errclass.New(errclass.Permanent, "image %s: sha256 mismatch: configured %s, downloaded %s", src.URL, src.SHA256, got)
	}
	if err := writeVolume(api, pool, src.markerName(), []byte(got)); err != nil {
		return "", err
	}
	return api.StorageVolGetPath(vol)
}

// createVolume creates a volume; with backing set it is a qcow2 overlay on
// that file.
func createVolume(api libvirtAPI, pool libvirt.StoragePool, name, format string, capacity uint64, backing *libvirtxml.StorageVolumeBackingStore) (libvirt.StorageVol, error) {
	doc := libvirtxml.StorageVolume{
		Name:         name,
		Capacity:     &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: capacity},
		Target:       &libvirtxml.StorageVolumeTarget{Format: &libvirtxml.StorageVolumeTargetFormat{Type: format}},
		BackingStore: backing,
	}
	if backing == nil && format == FormatRaw {
		doc.Allocation = &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: 0}
	}
	x, err := doc.Marshal()
	if err != nil {
		return libvirt.StorageVol{}, errclass.Wrap(errclass.Permanent, fmt.Errorf("volume %s: %w", name, err))
	}
	return api.StorageVolCreateXML(pool, x, 0)
}

// writeVolume creates a raw volume holding data.
func writeVolume(api libvirtAPI, pool libvirt.StoragePool, name string, data []byte) error {
	vol, err := createVolume(api, pool, name, FormatRaw, uint64(len(data)), nil)
	if err != nil {
		return err
	}
	if err := api.StorageVolUpload(vol, bytes.NewReader(data), 0, uint64(len(data)), 0); err != nil {
		_ = api.StorageVolDelete(vol, 0)
		return err
	}
	return nil
}

// deleteVolume removes a volume by name; a missing one is fine.
func deleteVolume(api libvirtAPI, pool libvirt.StoragePool, name string) error {
	vol, err := api.StorageVolLookupByName(pool, name)
	if hasCode(err, libvirt.ErrNoStorageVol) {
		return nil
	}
	if err != nil {
		return err
	}
	if err := api.StorageVolDelete(vol, 0); err != nil && !hasCode(err, libvirt.ErrNoStorageVol) {
		return err
	}
	return nil
}
