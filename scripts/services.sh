#!/usr/bin/env bash
# Make sure the services the tests need are there: a redis-server binary (the tests start their
# own server) and PostgreSQL on 127.0.0.1:5432. Starts or installs what is missing when it can.
set -euo pipefail

have_root_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }
apt_updated=0
apt_install() {
  if [ $apt_updated = 0 ]; then apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if ! command -v redis-server >/dev/null 2>&1; then
  if have_root_apt; then echo "services: installing redis-server"; apt_install redis-server
  else echo "services: redis-server is missing; install it (the tests start their own)"; exit 1; fi
fi
redis_version=$(redis-server --version | sed -n 's/.*v=\([0-9]*\.[0-9]*\).*/\1/p')
if [ "$(printf '%s\n7.0\n' "$redis_version" | sort -V | head -1)" != "7.0" ]; then
  echo "services: redis-server $redis_version is too old: inferq needs Redis 7.0 or later"; exit 1
fi

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
if ! command -v pg_isready >/dev/null 2>&1 && have_root_apt; then
  echo "services: installing PostgreSQL"; apt_install postgresql
fi
if ! pg_up; then
  if command -v pg_ctlcluster >/dev/null 2>&1 && ls /etc/postgresql >/dev/null 2>&1; then
    echo "services: starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
    for _ in $(seq 30); do pg_up && break; sleep 1; done
  fi
fi
if ! pg_up; then
  echo "services: PostgreSQL is not reachable on 127.0.0.1:5432 (set INFERQ_TEST_POSTGRES_URL)"
  exit 1
fi
# The tests connect as the postgres superuser; a stock install wants a password over TCP.
if ! psql -h 127.0.0.1 -U postgres -d postgres -tc "SELECT 1" >/dev/null 2>&1; then
  su postgres -c "psql -qc \"ALTER USER postgres PASSWORD 'postgres'\"" >/dev/null 2>&1 || true
fi
