#!/bin/sh
# Installs rendezvousd.service on this node from this checkout. As root:
#   deploy/systemd/install.sh
# It creates what the unit names:
#   - the user and group rendezvous (/etc/sysusers.d/rendezvous.conf, applied
#     with systemd-sysusers);
#   - the virtualenv /opt/rendezvous, holding pip install '.[daemon]' of this
#     checkout (bin/rendezvousd is ExecStart's command);
#   - /etc/rendezvous with rendezvousd.env and an example cluster.json (files
#     already there are kept: run it again to upgrade);
#   - /etc/systemd/system/rendezvousd.service.
# What only you can provide is listed at the end. PYTHON is the interpreter
# the virtualenv is made from (default python3, 3.11 or later, with venv:
# Debian's python3-venv); it must live outside /home and /root, which the
# unit hides from the service (ProtectHome=yes). DESTDIR=DIR installs under
# DIR instead of / (then nothing is reloaded).
set -eu

src=$(CDPATH='' cd -- "$(dirname -- "$0")/../.." && pwd)
root=${DESTDIR:-}
python=${PYTHON:-python3}

install -d -m 0755 "$root/etc/sysusers.d"
install -m 0644 "$src/deploy/systemd/rendezvous.sysusers" "$root/etc/sysusers.d/rendezvous.conf"
systemd-sysusers --root="${root:-/}" "$root/etc/sysusers.d/rendezvous.conf"

base=$("$python" -c 'import sys; print(sys.base_prefix)')
case "$base/" in
    /home/*|/root/*) echo "install.sh: warning: $python lives in $base, hidden from the service by ProtectHome=yes" >&2 ;;
esac
"$python" -m venv "$root/opt/rendezvous"
"$root/opt/rendezvous/bin/python" -m pip install --quiet --upgrade "$src[daemon]"

install -d -m 0755 "$root/etc/rendezvous"
[ -e "$root/etc/rendezvous/rendezvousd.env" ] ||
    install -m 0644 "$src/deploy/systemd/rendezvousd.env" "$root/etc/rendezvous/rendezvousd.env"
[ -e "$root/etc/rendezvous/cluster.json" ] ||
    install -m 0644 "$src/deploy/cluster.json" "$root/etc/rendezvous/cluster.json"
install -d -m 0755 "$root/etc/systemd/system"
install -m 0644 "$src/deploy/systemd/rendezvousd.service" "$root/etc/systemd/system/rendezvousd.service"
if [ -z "$root" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi

cat <<EOF
Installed rendezvousd.service. Before 'systemctl enable --now rendezvousd', in $root/etc/rendezvous:
  cluster.json         every node's address, the same file on every node
  rendezvousd.env      RENDEZVOUS_TASK_INDEX: this node's index in cluster.json
  node.pem, node.key   this node's TLS certificate (its cluster address in the SANs) and key
  ca.pem, token        the CA every node's certificate chains to; the token all nodes share
  (node.key and token: chgrp rendezvous, chmod 0640; or drop their lines from rendezvousd.env)
EOF
