#!/usr/bin/env bash
# Makes sure the KVM backend's integration and end-to-end tests have a real
# libvirtd to talk to: installs Debian's libvirt daemon, QEMU (software
# emulation is enough), qemu-img, OVMF and OpenSSH's server when missing,
# and what scripts/kvm-guest-image.sh makes the end-to-end test's bootable
# guest from (Debian's cloud kernel, busybox-static, SYSLINUX, mtools, cpio,
# kmod) plus dnsmasq, the DHCP server the tests run on their bridges; then
# starts virtlogd and libvirtd. This machine has no D-Bus, so the
# default polkit socket authentication cannot work: libvirtd gets its own
# config with the read-write socket open to the libvirt group and no
# authentication on it (group membership is the access control). The tests
# start their own sshd on a loopback port; the system sshd is not started.
# Needs root. Idempotent.
set -euo pipefail

conf_dir="${XDG_CACHE_HOME:-$HOME/.cache}/egress-proxies/libvirt"
socket=/var/run/libvirt/libvirt-sock

need=()
command -v libvirtd >/dev/null || [ -x /usr/sbin/libvirtd ] || need+=(libvirt-daemon-system)
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v qemu-img >/dev/null || need+=(qemu-utils)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
[ -e /usr/share/OVMF/OVMF_CODE.fd ] || [ -e /usr/share/OVMF/OVMF_CODE_4M.fd ] || need+=(ovmf)
# The bootable guest and its network.
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'; }
installed linux-image-cloud-amd64 || need+=(linux-image-cloud-amd64)
installed busybox-static || need+=(busybox-static) # the initramfs has no libc
command -v syslinux >/dev/null || need+=(syslinux syslinux-common)
command -v mcopy >/dev/null || need+=(mtools)
command -v cpio >/dev/null || need+=(cpio)
command -v modprobe >/dev/null || [ -x /sbin/modprobe ] || need+=(kmod)
command -v dnsmasq >/dev/null || [ -x /usr/sbin/dnsmasq ] || need+=(dnsmasq-base)
if [ ${#need[@]} -gt 0 ]; then
	echo "ensure-libvirt: installing ${need[*]}"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
	# The packages may start the system sshd where an init system runs; the
	# tests run their own.
fi

mkdir -p "$conf_dir" /run/sshd
cat >"$conf_dir/libvirtd.conf" <<CONF
unix_sock_group = "libvirt"
unix_sock_ro_perms = "0777"
unix_sock_rw_perms = "0770"
auth_unix_ro = "none"
auth_unix_rw = "none"
CONF

if ! pgrep -x virtlogd >/dev/null; then
	echo "ensure-libvirt: starting virtlogd"
	/usr/sbin/virtlogd -d
fi
if ! pgrep -x libvirtd >/dev/null; then
	echo "ensure-libvirt: starting libvirtd with $conf_dir/libvirtd.conf"
	/usr/sbin/libvirtd -d -f "$conf_dir/libvirtd.conf"
fi
for _ in $(seq 1 100); do
	if [ -S "$socket" ] && virsh -q -c qemu:///system version >/dev/null 2>&1; then
		echo "ensure-libvirt: libvirtd answers on $socket ($(virsh -c qemu:///system version --daemon 2>/dev/null | grep -i 'running against daemon' || true))"
		exit 0
	fi
	sleep 0.2
done
echo "ensure-libvirt: libvirtd does not answer on $socket" >&2
exit 1
