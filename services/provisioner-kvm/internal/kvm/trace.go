package kvm

import (
	"context"
	"io"
	"log/slog"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
)

// tracingAPI logs every libvirt call at DEBUG with its duration. It never
// logs XML documents or stream contents: a seed volume carries the proxy's
// cloud-init.
type tracingAPI struct {
	inner libvirtAPI
	log   *slog.Logger
	ctx   context.Context
}

func (t *tracingAPI) done(call string, start time.Time, err error, attrs ...any) {
	attrs = append(attrs, "call", call, "duration", time.Since(start))
	if err != nil {
		attrs = append(attrs, "error", err.Error())
	}
	t.log.DebugContext(t.ctx, "libvirt call", attrs...)
}

func (t *tracingAPI) ConnectGetLibVersion() (uint64, error) {
	s := time.Now()
	v, err := t.inner.ConnectGetLibVersion()
	t.done("ConnectGetLibVersion", s, err, "version", formatVersion(v))
	return v, err
}

func (t *tracingAPI) ConnectGetVersion() (uint64, error) {
	s := time.Now()
	v, err := t.inner.ConnectGetVersion()
	t.done("ConnectGetVersion", s, err, "version", formatVersion(v))
	return v, err
}

func (t *tracingAPI) ConnectGetHostname() (string, error) {
	s := time.Now()
	h, err := t.inner.ConnectGetHostname()
	t.done("ConnectGetHostname", s, err, "hostname", h)
	return h, err
}

func (t *tracingAPI) ConnectGetAllDomainStats(doms []libvirt.Domain, stats uint32, flags uint32) ([]libvirt.DomainStatsRecord, error) {
	s := time.Now()
	r, err := t.inner.ConnectGetAllDomainStats(doms, stats, flags)
	t.done("ConnectGetAllDomainStats", s, err, "stats", stats, "count", len(r))
	return r, err
}

func (t *tracingAPI) DomainLookupByName(name string) (libvirt.Domain, error) {
	s := time.Now()
	d, err := t.inner.DomainLookupByName(name)
	t.done("DomainLookupByName", s, err, "domain", name)
	return d, err
}

func (t *tracingAPI) DomainDefineXML(xml string) (libvirt.Domain, error) {
	s := time.Now()
	d, err := t.inner.DomainDefineXML(xml)
	t.done("DomainDefineXML", s, err, "domain", d.Name, "length", len(xml))
	return d, err
}

func (t *tracingAPI) DomainCreate(dom libvirt.Domain) error {
	s := time.Now()
	err := t.inner.DomainCreate(dom)
	t.done("DomainCreate", s, err, "domain", dom.Name)
	return err
}

func (t *tracingAPI) DomainGetState(dom libvirt.Domain, flags uint32) (int32, int32, error) {
	s := time.Now()
	st, r, err := t.inner.DomainGetState(dom, flags)
	t.done("DomainGetState", s, err, "domain", dom.Name, "state", st, "reason", r)
	return st, r, err
}

func (t *tracingAPI) DomainGetMetadata(dom libvirt.Domain, typ int32, uri libvirt.OptString, flags libvirt.DomainModificationImpact) (string, error) {
	s := time.Now()
	m, err := t.inner.DomainGetMetadata(dom, typ, uri, flags)
	t.done("DomainGetMetadata", s, err, "domain", dom.Name)
	return m, err
}

func (t *tracingAPI) DomainSetMetadata(dom libvirt.Domain, typ int32, metadata, key, uri libvirt.OptString, flags libvirt.DomainModificationImpact) error {
	s := time.Now()
	err := t.inner.DomainSetMetadata(dom, typ, metadata, key, uri, flags)
	t.done("DomainSetMetadata", s, err, "domain", dom.Name, "flags", uint32(flags))
	return err
}

func (t *tracingAPI) DomainGetXMLDesc(dom libvirt.Domain, flags libvirt.DomainXMLFlags) (string, error) {
	s := time.Now()
	x, err := t.inner.DomainGetXMLDesc(dom, flags)
	t.done("DomainGetXMLDesc", s, err, "domain", dom.Name, "length", len(x))
	return x, err
}

func (t *tracingAPI) DomainInterfaceAddresses(dom libvirt.Domain, source uint32, flags uint32) ([]libvirt.DomainInterface, error) {
	s := time.Now()
	i, err := t.inner.DomainInterfaceAddresses(dom, source, flags)
	t.done("DomainInterfaceAddresses", s, err, "domain", dom.Name, "source", source, "interfaces", len(i))
	return i, err
}

func (t *tracingAPI) DomainDestroy(dom libvirt.Domain) error {
	s := time.Now()
	err := t.inner.DomainDestroy(dom)
	t.done("DomainDestroy", s, err, "domain", dom.Name)
	return err
}

func (t *tracingAPI) DomainUndefineFlags(dom libvirt.Domain, flags libvirt.DomainUndefineFlagsValues) error {
	s := time.Now()
	err := t.inner.DomainUndefineFlags(dom, flags)
	t.done("DomainUndefineFlags", s, err, "domain", dom.Name, "flags", flags)
	return err
}

func (t *tracingAPI) StoragePoolLookupByName(name string) (libvirt.StoragePool, error) {
	s := time.Now()
	p, err := t.inner.StoragePoolLookupByName(name)
	t.done("StoragePoolLookupByName", s, err, "pool", name)
	return p, err
}

func (t *tracingAPI) StoragePoolGetInfo(pool libvirt.StoragePool) (uint8, uint64, uint64, uint64, error) {
	s := time.Now()
	st, c, a, av, err := t.inner.StoragePoolGetInfo(pool)
	t.done("StoragePoolGetInfo", s, err, "pool", pool.Name, "state", poolStateName(libvirt.StoragePoolState(st)), "capacity", c, "available", av)
	return st, c, a, av, err
}

func (t *tracingAPI) StorageVolLookupByName(pool libvirt.StoragePool, name string) (libvirt.StorageVol, error) {
	s := time.Now()
	v, err := t.inner.StorageVolLookupByName(pool, name)
	t.done("StorageVolLookupByName", s, err, "pool", pool.Name, "volume", name)
	return v, err
}

func (t *tracingAPI) StorageVolGetPath(vol libvirt.StorageVol) (string, error) {
	s := time.Now()
	p, err := t.inner.StorageVolGetPath(vol)
	t.done("StorageVolGetPath", s, err, "volume", vol.Name, "path", p)
	return p, err
}

func (t *tracingAPI) StorageVolCreateXML(pool libvirt.StoragePool, xml string, flags libvirt.StorageVolCreateFlags) (libvirt.StorageVol, error) {
	s := time.Now()
	v, err := t.inner.StorageVolCreateXML(pool, xml, flags)
	t.done("StorageVolCreateXML", s, err, "pool", pool.Name, "volume", v.Name)
	return v, err
}

func (t *tracingAPI) StorageVolUpload(vol libvirt.StorageVol, r io.Reader, offset, length uint64, flags libvirt.StorageVolUploadFlags) error {
	s := time.Now()
	err := t.inner.StorageVolUpload(vol, r, offset, length, flags)
	t.done("StorageVolUpload", s, err, "volume", vol.Name, "length", length)
	return err
}

func (t *tracingAPI) StorageVolDownload(vol libvirt.StorageVol, w io.Writer, offset, length uint64, flags libvirt.StorageVolDownloadFlags) error {
	s := time.Now()
	err := t.inner.StorageVolDownload(vol, w, offset, length, flags)
	t.done("StorageVolDownload", s, err, "volume", vol.Name, "length", length)
	return err
}

func (t *tracingAPI) StoragePoolListAllVolumes(pool libvirt.StoragePool, needResults int32, flags uint32) ([]libvirt.StorageVol, uint32, error) {
	s := time.Now()
	v, n, err := t.inner.StoragePoolListAllVolumes(pool, needResults, flags)
	t.done("StoragePoolListAllVolumes", s, err, "pool", pool.Name, "volumes", len(v))
	return v, n, err
}

func (t *tracingAPI) StorageVolGetXMLDesc(vol libvirt.StorageVol, flags uint32) (string, error) {
	s := time.Now()
	x, err := t.inner.StorageVolGetXMLDesc(vol, flags)
	t.done("StorageVolGetXMLDesc", s, err, "volume", vol.Name, "xmlLength", len(x))
	return x, err
}

func (t *tracingAPI) StorageVolDelete(vol libvirt.StorageVol, flags libvirt.StorageVolDeleteFlags) error {
	s := time.Now()
	err := t.inner.StorageVolDelete(vol, flags)
	t.done("StorageVolDelete", s, err, "volume", vol.Name)
	return err
}
