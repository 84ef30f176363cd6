#!/bin/sh
# CRIU from Debian trixie in a private prefix (made by scripts/install-criu.sh).
# It needs a newer glibc than the host may have, so it runs through the prefix's
# own loader with the prefix's libraries first. The prefix is found from this
# file's location, so the folder can be moved; no LD_* variable is exported to
# the programs criu starts. An inherited LD_LIBRARY_PATH is searched after the
# prefix (plugins may dlopen host libraries such as libcuda through it).
self=$(readlink -f -- "$0") || exit 127
prefix=${self%/*/*}
case $prefix in
    *:*) echo "criu wrapper: prefix path must not contain ':': $prefix" >&2; exit 127 ;;
esac
exec "$prefix/libexec/criu" \
    --library-path "$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    --argv0 "$0" "$prefix/usr/sbin/criu" "$@"
