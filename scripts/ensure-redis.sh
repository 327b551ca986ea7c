#!/usr/bin/env bash
# Make sure a Redis server answers on 127.0.0.1:6379, as on the development and CI machines (the
# gateways' shared rate limits are tested against it). Installs Debian's redis-server if there is
# none, starts it if it is down, and waits until it answers. Does nothing when one already answers.
set -euo pipefail
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
answers() { (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; }

if answers; then exit 0; fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "ensure-redis: installing Debian's redis-server" >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
if ! answers; then
  # No init system to ask in a container: start it ourselves, in the background, no persistence.
  as_root redis-server --bind 127.0.0.1 --port 6379 --daemonize yes --save "" --appendonly no \
    --logfile /tmp/ensure-redis.log
fi
for _ in $(seq 1 30); do answers && break; sleep 1; done
answers || { echo "ensure-redis: Redis did not come up on 127.0.0.1:6379" >&2; exit 1; }
