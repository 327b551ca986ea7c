#!/usr/bin/env bash
# Make sure a PostgreSQL server answers on 127.0.0.1:5432 with trust auth and a database
# `test`, as on the development and CI machines. Starts an installed cluster if it is down;
# installs Debian's postgresql if there is none. Does nothing when one already answers.
set -euo pipefail
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
answers() { (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null; }

if answers; then exit 0; fi
if ! command -v pg_ctlcluster >/dev/null 2>&1; then
  echo "ensure-postgres: installing Debian's postgresql" >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
fi
version=$(ls /etc/postgresql | sort -V | tail -n 1)
hba=/etc/postgresql/$version/main/pg_hba.conf
if ! as_root grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
  as_root sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
fi
as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start 2>/dev/null \
  || as_root pg_ctlcluster --skip-systemctl-redirect "$version" main reload
for _ in $(seq 1 30); do answers && break; sleep 1; done
answers || { echo "ensure-postgres: PostgreSQL did not come up on 127.0.0.1:5432" >&2; exit 1; }
if ! psql -h 127.0.0.1 -U postgres -tAc "select 1 from pg_database where datname='test'" | grep -q 1; then
  psql -h 127.0.0.1 -U postgres -c 'create database test' >/dev/null
fi
