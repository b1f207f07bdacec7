#!/usr/bin/env bash
# Certificates for specsplit's TLS (openssl; PEM; EC P-256). Keep ca.key offline once the hosts have theirs.
#
#   deploy/make-certs.sh DIR NAME SAN[,SAN...]   e.g.  deploy/make-certs.sh pki gpu-1 DNS:gpu-1.example.com,IP:10.0.0.5
#
# Makes DIR/ca.pem + DIR/ca.key (a new CA) unless they exist, then DIR/NAME.pem + DIR/NAME.key signed by it, valid for
# the given subject alternative names, for serving (--tls-cert) and for calling as a client (mutual TLS).
# DAYS (default 365) sets how long the host certificate lasts; the CA lasts ten times as long.
set -euo pipefail
if [[ $# -ne 3 ]]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
dir=$1 name=$2 san=$3 days=${DAYS:-365}
for entry in ${san//,/ }; do
    if [[ ! $entry =~ ^(DNS|IP):.+ ]]; then
        echo "make-certs.sh: '$entry' is not a subject alternative name: write DNS:host.example.com or IP:10.0.0.5" >&2
        exit 2
    fi
done
mkdir -p "$dir"
cd "$dir"
log=$(mktemp)
trap 'rc=$?; if [[ $rc -ne 0 ]]; then cat "$log" >&2; rm -f "$name.csr" "$name.ext" "$name.key"; fi; rm -f "$log"' EXIT
key=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
if [[ ! -f ca.pem ]]; then
    openssl req -x509 "${key[@]}" -keyout ca.key -out ca.pem -days $((days * 10)) -subj "/CN=specsplit CA $(date +%F)" 2>"$log"
    chmod 600 ca.key
fi
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$san" > "$name.ext"
openssl req "${key[@]}" -keyout "$name.key" -out "$name.csr" -subj "/CN=$name" 2>"$log"
openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$name.pem" -days "$days" \
    -extfile "$name.ext" 2>"$log"
chmod 600 "$name.key"
rm -f "$name.csr" "$name.ext"
echo "$dir/$name.pem, $dir/$name.key (signed by $dir/ca.pem) for $san"
