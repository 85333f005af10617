package lifecycle

import "time"

// Drain marks p draining from now: the lease service hands it out no more,
// and it is deleted once its leases end or, at the latest, after timeout.
// Draining again keeps the first deadline.
func Drain(p *Proxy, now time.Time, timeout time.Duration) {
	if p.Draining() {
		return
	}
	p.DrainTime, p.DrainDeadline = &now, at(now.Add(timeout))
}

// Undrain ends p's draining: it is leasable again.
func Undrain(p *Proxy) { p.DrainTime, p.DrainDeadline = nil, nil }
