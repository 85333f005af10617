package kvm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

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

// baseKey names the image in its volumes: its key, or for a direct URL
// the first 16 hex of the URL's SHA-256.
func (s imageSource) baseKey() string {
	if s.Key != "" {
		return s.Key
	}
	sum := sha256.Sum256([]byte(s.URL))
	return hex.EncodeToString(sum[:8])
}

// digestTag is the part of the base's name that versions it: "@" and the
// first 16 hex of the configured digest, "" without one. "@" is not
// allowed in an image key, so no key's names collide with another's.
func (s imageSource) digestTag() string {
	if s.SHA256 == "" {
		return ""
	}
	return "@" + s.SHA256[:16]
}

// volumeName is the cached base's volume: base-<key>@<digest16>.<format>,
// or base-<key>.<format> without a configured digest. A changed digest is
// a new volume beside the old one, which overlays keep backing onto.
func (s imageSource) volumeName() string {
	return "base-" + s.baseKey() + s.digestTag() + "." + s.Format
}

// markerName is the volume holding the verified digest of the base. It is
// written only after the base's upload completed and verified, so a base
// without its marker is a partial upload and never used.
func (s imageSource) markerName() string { return s.volumeName() + ".sha256" }

// ofImage tells whether name is a base or marker of this image, of any
// digest or format (the versions the sweep looks at).
func (s imageSource) ofImage(name string) bool {
	rest, ok := strings.CutPrefix(name, "base-"+s.baseKey())
	if !ok {
		return false
	}
	rest = strings.TrimSuffix(rest, ".sha256")
	cut := false
	for _, f := range []string{FormatQcow2, FormatRaw} {
		if r, ok := strings.CutSuffix(rest, "."+f); ok {
			rest, cut = r, true
			break
		}
	}
	if !cut {
		return false
	}
	if rest == "" {
		return true
	}
	tag, ok := strings.CutPrefix(rest, "@")
	if !ok || len(tag) != 16 {
		return false
	}
	_, err := hex.DecodeString(tag)
	return err == nil
}

// staleUpload is how long a base without marker must have gone unwritten
// before it is taken for an upload that died with its process. An upload
// writes continuously, and another provisioner process sharing the host
// may be running it: removing it early would corrupt that upload.
const staleUpload = 10 * time.Minute

// imageCache downloads each base once per host; concurrent callers for the
// same image on the same host share one download.
type imageCache struct {
	http   *http.Client
	log    *slog.Logger
	now    func() time.Time
	flight singleflight.Group

	mu      sync.Mutex
	lookups map[string]*lookup // bounded lookups under way, by key
}

// newImageCache's clock is the wall clock, whatever Options.Now says: it
// is compared with the mtime the host reports.
func newImageCache(c *http.Client, log *slog.Logger) *imageCache {
	if c == nil {
		c = http.DefaultClient
	}
	return &imageCache{http: c, log: log, now: time.Now, lookups: map[string]*lookup{}}
}

// ensure returns the path of src's base volume in pool on host, downloading
// and verifying it first when the pool has no complete, current copy; then,
// in the same flight, it removes the image's other versions that no volume
// backs onto. The flight is per version: callers still on another digest
// (a config reload under way) must not be handed this one's path.
func (ic *imageCache) ensure(ctx context.Context, api libvirtAPI, host string, pool libvirt.StoragePool, src imageSource) (string, error) {
	return ic.once(host+"/"+pool.Name+"/"+src.volumeName(), func() (string, error) {
		p, err := ic.ensureOnce(ctx, api, pool, src)
		if err != nil {
			return "", err
		}
		ic.sweep(ctx, api, host, pool, src, p)
		return p, nil
	})
}

// cached returns the path of src's base when the pool holds a complete,
// current copy (and sweeps the image's other versions, as ensure does),
// "" otherwise. It changes nothing else: it is the part of a Create that
// is bounded, the download being the part that is not.
func (ic *imageCache) cached(ctx context.Context, api libvirtAPI, host string, pool libvirt.StoragePool, src imageSource) (string, error) {
	return ic.onceWithin(ctx, host+"/"+pool.Name+"/"+src.volumeName()+"#cached", func() (string, error) {
		_, p, err := complete(api, pool, src)
		if err != nil || p == "" {
			return "", err
		}
		ic.sweep(ctx, api, host, pool, src, p)
		return p, nil
	})
}

// onceWithin is once for a bounded lookup: a caller whose ctx ends stops
// waiting, and a lookup whose starter's ctx has ended is never joined: the
// next caller runs fn afresh. The lookup runs on its starter's connection,
// which is dropped when that ctx ends, so it may never return (a libvirt
// connection that stopped answering: docs/provisioner-kvm.md). Checking
// the starter's ctx when joining, rather than forgetting the key when a
// waiter notices its ctx ended, holds even when the abandoned waiter is
// scheduled after the next caller.
func (ic *imageCache) onceWithin(ctx context.Context, key string, fn func() (string, error)) (string, error) {
	ic.mu.Lock()
	l, ok := ic.lookups[key]
	if !ok || l.starter.Err() != nil {
		l = &lookup{starter: ctx, done: make(chan struct{})}
		ic.lookups[key] = l
		go func() {
			l.path, l.err = fn()
			ic.mu.Lock()
			if ic.lookups[key] == l {
				delete(ic.lookups, key)
			}
			ic.mu.Unlock()
			close(l.done)
		}()
	}
	ic.mu.Unlock()
	select {
	case <-l.done:
		return l.path, l.err
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

// lookup is one run of a bounded lookup, shared by the callers that join
// it while its starter still waits.
type lookup struct {
	starter context.Context
	done    chan struct{} // closed once path and err are set
	path    string
	err     error
}

// once runs fn for key, shared by concurrent callers.
func (ic *imageCache) once(key string, fn func() (string, error)) (string, error) {
	v, err, _ := ic.flight.Do(key, func() (any, error) { return fn() })
	if err != nil {
		return "", err
	}
	return v.(string), nil
}

// complete looks up src's base: its path when its marker holds the
// configured digest (any digest without one), "" otherwise; base is nil
// when there is no base volume at all.
func complete(api libvirtAPI, pool libvirt.StoragePool, src imageSource) (base *libvirt.StorageVol, path string, err error) {
	vol, err := api.StorageVolLookupByName(pool, src.volumeName())
	if hasCode(err, libvirt.ErrNoStorageVol) {
		return nil, "", nil
	}
	if err != nil {
		return nil, "", err
	}
	marker, err := readMarker(api, pool, src.markerName())
	if err != nil {
		return nil, "", err
	}
	if marker == "" || (src.SHA256 != "" && marker != src.SHA256) {
		return &vol, "", nil
	}
	path, err = api.StorageVolGetPath(vol)
	return &vol, path, err
}

func (ic *imageCache) ensureOnce(ctx context.Context, api libvirtAPI, pool libvirt.StoragePool, src imageSource) (string, error) {
	base, p, err := complete(api, pool, src)
	if err != nil || p != "" {
		return p, err
	}
	if base != nil {
		// No marker: being uploaded, here by another process, or left by
		// one that died. Only the latter may go.
		age, err := ic.unwrittenFor(api, *base)
		if err != nil {
			return "", err
		}
		if age < staleUpload {
			return "", errclass.New(errclass.Transient, "image %s: base volume %s has no valid marker and was written %s ago: another process is uploading it (it is taken for abandoned after %s unwritten)",
				src.URL, src.volumeName(), age.Round(time.Second), staleUpload)
		}
		// Only a base whose marker was seen gets overlays; one without
		// its marker that has some lost it by accident and is not ours to
		// delete.
		vols, _, err := api.StoragePoolListAllVolumes(pool, 1, 0)
		if err != nil {
			return "", err
		}
		backing, err := backingPaths(api, vols, src)
		if err != nil {
			return "", err
		}
		p, err := api.StorageVolGetPath(*base)
		if err != nil {
			return "", err
		}
		if n := backing[p]; n > 0 {
			return "", errclass.New(errclass.Transient, "image %s: base volume %s has no valid marker and %d volumes back onto it; it is left alone (delete its overlays, or write its digest into %s)",
				src.URL, src.volumeName(), n, src.markerName())
		}
		if err := deleteVolume(api, pool, src.volumeName()); err != nil {
			return "", err
		}
		ic.log.InfoContext(ctx, "abandoned partial base image removed", "pool", pool.Name, "volume", src.volumeName(), "unwrittenFor", age.Round(time.Second).String())
	}
	// Only the base is deleted here, never a marker alone: the base may
	// be another process's by now, and its marker with it.
	return ic.download(ctx, api, pool, src)
}

// unwrittenFor is how long ago vol was last written, from its mtime.
func (ic *imageCache) unwrittenFor(api libvirtAPI, vol libvirt.StorageVol) (time.Duration, error) {
	x, err := api.StorageVolGetXMLDesc(vol, 0)
	if err != nil {
		return 0, err
	}
	var doc libvirtxml.StorageVolume
	if err := doc.Unmarshal(x); err != nil {
		return 0, errclass.Wrap(errclass.Transient, fmt.Errorf("volume %s: %w", vol.Name, err))
	}
	if doc.Target == nil || doc.Target.Timestamps == nil {
		// A pool type without timestamps: nothing says it is being
		// written, so it is taken for abandoned.
		return staleUpload, nil
	}
	sec, _, _ := strings.Cut(doc.Target.Timestamps.Mtime, ".")
	n, err := strconv.ParseInt(sec, 10, 64)
	if err != nil {
		return staleUpload, nil //nolint:nilerr // an unreadable mtime says nothing either
	}
	return ic.now().Sub(time.Unix(n, 0)), nil
}

// sweep removes the image's other versions (other digests, the name
// without a digest, another format) that no volume in the pool backs
// onto, each with its marker, and markers left without their base. A
// version without a marker that was written recently is another process's
// upload and stays. Failing is not the caller's failure: the next ensure
// sweeps again.
func (ic *imageCache) sweep(ctx context.Context, api libvirtAPI, host string, pool libvirt.StoragePool, src imageSource, keepPath string) {
	vols, _, err := api.StoragePoolListAllVolumes(pool, 1, 0)
	if err != nil {
		ic.log.DebugContext(ctx, "old base images not swept", "host", host, "pool", pool.Name, "error", err.Error())
		return
	}
	names := map[string]bool{}
	for _, v := range vols {
		names[v.Name] = true
	}
	var old []libvirt.StorageVol
	for _, v := range vols {
		if v.Name == src.volumeName() || v.Name == src.markerName() || !src.ofImage(v.Name) {
			continue
		}
		if base, ok := strings.CutSuffix(v.Name, ".sha256"); ok {
			if !names[base] {
				_ = deleteVolume(api, pool, v.Name) // its base is gone already
			}
			continue
		}
		old = append(old, v)
	}
	if len(old) == 0 {
		return
	}
	backing, err := backingPaths(api, vols, src)
	if err != nil {
		ic.log.DebugContext(ctx, "old base images not swept", "host", host, "pool", pool.Name, "error", err.Error())
		return
	}
	for _, v := range old {
		p, err := api.StorageVolGetPath(v)
		if err != nil || p == keepPath {
			continue
		}
		if n := backing[p]; n > 0 {
			ic.log.DebugContext(ctx, "old base image kept: volumes back onto it", "host", host, "pool", pool.Name, "volume", v.Name, "overlays", n)
			continue
		}
		if !names[v.Name+".sha256"] {
			if age, err := ic.unwrittenFor(api, v); err != nil || age < staleUpload {
				continue // another process's upload
			}
		}
		// The base before its marker: a marker without its base is never
		// taken for a complete copy.
		if err := api.StorageVolDelete(v, 0); err != nil && !hasCode(err, libvirt.ErrNoStorageVol) {
			ic.log.DebugContext(ctx, "old base image not removed", "host", host, "pool", pool.Name, "volume", v.Name, "error", err.Error())
			continue
		}
		_ = deleteVolume(api, pool, v.Name+".sha256")
		ic.log.InfoContext(ctx, "old base image removed: no volume backs onto it", "host", host, "pool", pool.Name, "volume", v.Name, "current", src.volumeName())
	}
}

// backingPaths counts, per path, the volumes of the pool that back onto
// it. The image's own bases and markers and the seeds (raw files this
// provider wrote) are skipped; every other volume is read, whoever made
// it.
func backingPaths(api libvirtAPI, vols []libvirt.StorageVol, src imageSource) (map[string]int, error) {
	out := map[string]int{}
	for _, v := range vols {
		if src.ofImage(v.Name) || strings.HasSuffix(v.Name, ".sha256") || (strings.HasPrefix(v.Name, namePrefix) && strings.HasSuffix(v.Name, "-seed.iso")) {
			continue
		}
		x, err := api.StorageVolGetXMLDesc(v, 0)
		if hasCode(err, libvirt.ErrNoStorageVol) {
			continue // deleted meanwhile
		}
		if err != nil {
			return nil, err
		}
		var doc libvirtxml.StorageVolume
		if err := doc.Unmarshal(x); err != nil {
			return nil, errclass.Wrap(errclass.Transient, fmt.Errorf("volume %s: %w", v.Name, err))
		}
		if doc.BackingStore != nil && doc.BackingStore.Path != "" {
			out[doc.BackingStore.Path]++
		}
	}
	return out, nil
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
	if hasCode(err, libvirt.ErrStorageVolExist) {
		// libvirt makes a name once: another process got there first.
		return "", errclass.New(errclass.Transient, "image %s: base volume %s was created meanwhile: another process is uploading it", src.URL, src.volumeName())
	}
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
	err = writeVolume(api, pool, src.markerName(), []byte(got))
	if hasCode(err, libvirt.ErrStorageVolExist) {
		// A marker of an earlier base of this name, removed before it:
		// this process made the base, so the marker is this one's to write.
		if err = deleteVolume(api, pool, src.markerName()); err == nil {
			err = writeVolume(api, pool, src.markerName(), []byte(got))
		}
	}
	if err != nil {
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
