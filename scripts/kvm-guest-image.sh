#!/usr/bin/env bash
# Builds (or reuses) the KVM tests' bootable guest and prints its path: a
# qcow2 disk holding a FAT file system made bootable by SYSLINUX (BIOS),
# Debian's cloud kernel and a busybox initramfs. The guest's init loads the
# virtio NIC's modules, takes an address by DHCP on the NIC's network and
# then pings its DHCP server's router address every few seconds, so the
# host always has a fresh neighbour entry for it. Nothing else runs: no
# guest agent, no cloud-init.
#
# Everything is made from Debian packages installed by
# scripts/ensure-libvirt.sh (linux-image-cloud-amd64, busybox-static,
# syslinux, mtools, cpio, kmod, qemu-utils) without loop mounts or root
# file-system access. The image is cached under
# ${XDG_CACHE_HOME:-~/.cache}/egress-proxies/kvm-guest-<key>/, the key
# hashing this script and the versions of the packages it is made from.
set -euo pipefail

fail() {
	echo "kvm-guest-image: $*; run scripts/ensure-libvirt.sh as root" >&2
	exit 1
}
version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || fail "package $1 is not installed"; }

kpkg=$(dpkg-query -W -f='${Depends}' linux-image-cloud-amd64 2>/dev/null | sed 's/[ ,(].*//') ||
	fail "linux-image-cloud-amd64 is not installed"
[ -n "$kpkg" ] || fail "linux-image-cloud-amd64 depends on no kernel package"
kver=${kpkg#linux-image-}
vmlinuz=/boot/vmlinuz-$kver
[ -r "$vmlinuz" ] || fail "$vmlinuz is missing"
for tool in busybox mformat mcopy syslinux cpio modprobe qemu-img gzip; do
	command -v "$tool" >/dev/null || [ -x "/bin/$tool" ] || [ -x "/sbin/$tool" ] || fail "$tool is missing"
done
busybox=/bin/busybox
[ -x "$busybox" ] || fail "$busybox (busybox-static) is missing"

inputs="$kpkg=$(version "$kpkg") busybox-static=$(version busybox-static) syslinux=$(version syslinux) syslinux-common=$(version syslinux-common)"
key=$({
	echo "$inputs"
	cat "$0"
} | sha256sum | cut -c1-16)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/egress-proxies
dir=$cache/kvm-guest-$key
if [ -s "$dir/guest.qcow2" ]; then
	echo "$dir/guest.qcow2"
	exit 0
fi
mkdir -p "$cache"
work=$(mktemp -d "$cache/kvm-guest-$key.tmp.XXXXXX")
trap 'rm -rf "$work"' EXIT

# The initramfs: busybox, the NIC's modules in load order, init.
root=$work/root
mkdir -p "$root"/{bin,dev,proc,sys,tmp,lib/modules}
cp "$busybox" "$root/bin/busybox"
for applet in sh mount insmod ip udhcpc ping sleep cat echo; do
	ln -s busybox "$root/bin/$applet"
done
: >"$root/modules"
# One module per modprobe call: further words would be module parameters.
for m in virtio_pci virtio_net; do modprobe -S "$kver" --show-depends "$m"; done | while read -r verb path _; do
	[ "$verb" = insmod ] || continue
	name=$(basename "$path")
	grep -qx "$name" "$root/modules" && continue
	cp "$path" "$root/lib/modules/$name"
	echo "$name" >>"$root/modules"
done
[ -s "$root/modules" ] || fail "modprobe found no modules for virtio_net in kernel $kver"

cat >"$root/init" <<'INIT'
#!/bin/sh
# The KVM tests' guest: bring up the virtio NIC, take an address by DHCP,
# then keep talking to the router so the host keeps a neighbour entry.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules); do insmod "/lib/modules/$m"; done
ip link set lo up
until ip link set eth0 up 2>/dev/null; do sleep 1; done
echo "guest: eth0 is up, asking for an address by DHCP" >/dev/console
# In the background it renews the lease for as long as the guest runs.
udhcpc -b -i eth0 -s /bin/dhcp-event -p /tmp/udhcpc.pid >/dev/null 2>&1
until [ -s /tmp/router ]; do sleep 1; done
router=$(cat /tmp/router)
echo "guest: pinging $router every 5s" >/dev/console
while :; do
	ping -c 1 -W 2 "$router" >/dev/null 2>&1
	sleep 5
done
INIT
cat >"$root/bin/dhcp-event" <<'EVENT'
#!/bin/sh
# udhcpc's event script: apply the lease to the interface.
case "$1" in
deconfig)
	ip -4 addr flush dev "$interface"
	;;
bound | renew)
	ip -4 addr flush dev "$interface"
	ip addr add "$ip/$mask" dev "$interface"
	r=${router%% *}
	echo "${r:-$serverid}" >/tmp/router
	echo "guest: $interface has $ip/$mask" >/dev/console
	;;
esac
EVENT
chmod 0755 "$root/init" "$root/bin/dhcp-event"
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -9) >"$work/initrd.gz"

# The boot disk: a FAT file system with SYSLINUX in its boot sector, no
# partition table (SeaBIOS boots it as it boots a floppy-style volume).
cat >"$work/syslinux.cfg" <<'CFG'
DEFAULT guest
PROMPT 0
TIMEOUT 0
LABEL guest
  KERNEL vmlinuz
  INITRD initrd.gz
  APPEND console=ttyS0 quiet loglevel=3 panic=5
CFG
raw=$work/disk.raw
truncate -s 48M "$raw"
mformat -i "$raw" -v GUEST -t 96 -h 16 -s 64 ::
syslinux --install "$raw"
mcopy -i "$raw" "$vmlinuz" ::vmlinuz
mcopy -i "$raw" "$work/initrd.gz" ::initrd.gz
mcopy -i "$raw" "$work/syslinux.cfg" ::syslinux.cfg
qemu-img convert -q -f raw -O qcow2 "$raw" "$work/guest.qcow2"
printf '%s\n' "$inputs" >"$work/inputs"

mkdir -p "$work/out"
mv "$work/guest.qcow2" "$work/inputs" "$work/out/"
# Another builder may have won the race; its image is as good as ours.
mv -T "$work/out" "$dir" 2>/dev/null || [ -s "$dir/guest.qcow2" ] || fail "cannot create $dir"
echo "$dir/guest.qcow2"
