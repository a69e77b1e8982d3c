#!/usr/bin/env bash
# Makes the files compose.yaml takes as secrets, in deploy/secrets/ (or the folder given):
#   ca.pem, ca.key          a private CA (its key stays here: it signs the server certificate)
#   server.pem, server.key  the schedulers' public-port certificate for localhost, 127.0.0.1 and ::1
#                           (and the compose host names scheduler, scheduler-tp, scheduler-dp)
#   api_keys                one random API key (clients send "authorization: Bearer <key>")
#   worker_secret           the secret each scheduler and its workers share
#   grafana_admin_password  Grafana's admin password
# Files that exist are kept: delete one to make it anew (the schedulers re-read certificates and
# API keys when they change). Extra names for the certificate: SERVER_NAMES="DNS:gpu1.example,IP:10.0.0.5".
# The folder is private to its owner (0700); the files are 0644 so that the containers' non-root
# users can read the bind-mounted secrets (other host users cannot enter the folder).
set -euo pipefail

dir="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/secrets}"
days="${DAYS:-825}"
mkdir -p "$dir"
chmod 700 "$dir"
cd "$dir"
[ -e .gitignore ] || printf '# made by deploy/make-compose-secrets.sh: never commit these\n*\n' > .gitignore

random() { openssl rand -hex 32; }
made=()
if [ ! -e ca.pem ] || [ ! -e ca.key ]; then
  openssl req -x509 -newkey rsa:3072 -nodes -sha256 -days "$days" -subj "/CN=nanovllm compose CA" \
    -keyout ca.key -out ca.pem 2>/dev/null
  rm -f server.pem  # a new CA: the server certificate must be signed again
  made+=(ca.pem)
fi
if [ ! -e server.pem ] || [ ! -e server.key ]; then
  names="DNS:localhost,IP:127.0.0.1,IP:::1,DNS:scheduler,DNS:scheduler-tp,DNS:scheduler-dp"
  [ -z "${SERVER_NAMES:-}" ] || names="$names,$SERVER_NAMES"
  [ -e server.key ] || openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:3072 -out server.key 2>/dev/null
  openssl req -new -key server.key -subj "/CN=localhost" -out server.csr
  printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
    "$names" > server.ext
  openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -sha256 -days "$days" \
    -extfile server.ext -out server.pem 2>/dev/null
  rm -f server.csr server.ext ca.srl
  made+=(server.pem)
fi
for name in api_keys worker_secret grafana_admin_password; do
  if [ ! -e "$name" ]; then
    random > "$name"
    made+=("$name")
  fi
done
chmod 644 ca.pem server.pem server.key api_keys worker_secret grafana_admin_password
chmod 600 ca.key
echo "deploy/make-compose-secrets.sh: ${#made[@]} made (${made[*]:-none}), the rest kept, in $dir"
