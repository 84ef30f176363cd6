#!/usr/bin/env bash
# Tests the Debian package end to end, as root on a Debian 12 machine (scripts/test.sh runs it):
# builds it (scripts/package-deb.sh), checks its files, control fields and conffile, installs it
# with dpkg -i, checks the installed plugin (its CR_PLUGIN_DESC symbol, that CRIU loads it from
# /usr/lib/criu with no --libdir, the manual page), runs the container test that uses the
# installed plugin, then purges the package and checks that nothing of it is left.
#
# The package is purged however the script ends. It refuses to start where the plugin or the
# package is installed already (or /etc/criu/gpu-plugin.conf exists), so as not to replace or
# purge a user's own installation.
set -euo pipefail
REPO=$(cd "$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)
cd "$REPO"

PKG=criu-gpu-plugin
PLUGIN=/usr/lib/criu/gpu_plugin.so
CONF=/etc/criu/gpu-plugin.conf
MAN=/usr/share/man/man7/criu-gpu-plugin.7.gz
TOOL=/usr/bin/criu-gpu
TOOL_MAN=/usr/share/man/man8/criu-gpu.8.gz
DOC=/usr/share/doc/$PKG

say() { printf '[test-deb] %s\n' "$*"; }
die() { printf '[test-deb] ERROR: %s\n' "$*" >&2; exit 1; }

# dpkg's view of the package: empty when dpkg has never heard of it.
pkg_status() { dpkg-query -W -f='${db:Status-Abbrev}' "$PKG" 2>/dev/null || true; }
is_known() { local s; s=$(pkg_status); [ -n "$s" ] && [ "${s:0:2}" != "un" ]; }

[ "$(id -u)" = 0 ] || die "needs root (dpkg -i)"
command -v dpkg >/dev/null || die "needs dpkg (a Debian or Ubuntu machine)"

# Someone's own installation: leave it alone.
if is_known; then
    die "package $PKG is already known to dpkg (status '$(pkg_status)'); this test would replace and purge it. Remove it first (dpkg --purge $PKG) if that is intended."
fi
for f in "$PLUGIN" "$CONF" "$TOOL"; do
    if [ -e "$f" ] || [ -L "$f" ]; then
        die "$f already exists (an installation not made by this test?); this test would overwrite it and then delete it. Move it away first."
    fi
done

# What the purge must leave as it was: directories this package may create.
existed=()
for d in /etc/criu /usr/lib/criu "$DOC"; do
    [ -d "$d" ] && existed+=("$d")
done
existed_before() { local d; for d in "${existed[@]}"; do [ "$d" = "$1" ] && return 0; done; return 1; }

scripts/setup.sh
export CRIU_BIN=${CRIU_BIN:-$REPO/.criu/bin/criu}

say "building the package"
deb=$(scripts/package-deb.sh | tail -n 1)
[ -f "$deb" ] || die "scripts/package-deb.sh made no package (last line: $deb)"
say "package: $deb"

# --- The .deb itself ---------------------------------------------------------------------------
expected_files="./etc/criu/gpu-plugin.conf
./usr/bin/criu-gpu
./usr/lib/criu/gpu_plugin.so
./usr/share/doc/$PKG/changelog.Debian.gz
./usr/share/doc/$PKG/copyright
./usr/share/lintian/overrides/$PKG
./usr/share/man/man7/criu-gpu-plugin.7.gz
./usr/share/man/man8/criu-gpu.8.gz"
files=$(dpkg-deb --contents "$deb" | awk '$1 !~ /^d/ { print $6 }' | LC_ALL=C sort)
[ "$files" = "$expected_files" ] ||
    die "unexpected package contents:"$'\n'"$files"$'\n'"expected:"$'\n'"$expected_files"
not_root=$(dpkg-deb --contents "$deb" | awk '$2 != "root/root"')
[ -z "$not_root" ] || die "entries not owned by root/root:"$'\n'"$not_root"

field() { dpkg-deb --field "$deb" "$1"; }
pkgid=$(cargo pkgid --locked -p "$PKG")
upstream=${pkgid##*[@#]}
[ "$(field Package)" = "$PKG" ] || die "Package is '$(field Package)'"
[ "$(field Architecture)" = amd64 ] || die "Architecture is '$(field Architecture)'"
case $(field Version) in "$upstream"-*) ;; *) die "Version '$(field Version)' is not $upstream-<revision>" ;; esac
case $(field Depends) in *"libc6 (>= "*) ;; *) die "Depends '$(field Depends)' lacks libc6" ;; esac
conffiles=$(dpkg-deb --info "$deb" conffiles)
[ "$conffiles" = "$CONF" ] || die "conffiles is '$conffiles', expected $CONF"
# Installing the example settings must change nothing: every line a comment or blank.
active=$(dpkg-deb --fsys-tarfile "$deb" | tar -xO ".$CONF" | grep -nEv '^[[:space:]]*(#|$)' || true)
[ -z "$active" ] || die "$CONF in the package sets something:"$'\n'"$active"
say "package contents, control fields and conffile: ok"

# --- Installed ----------------------------------------------------------------------------------
work=$(mktemp -d)
sleeper=""
cleanup() {
    local rc=$?
    [ -z "$sleeper" ] || kill "$sleeper" 2>/dev/null || true
    rm -rf "$work"
    if is_known; then
        say "purging $PKG"
        dpkg --purge "$PKG" || rc=1
    fi
    exit "$rc"
}
trap cleanup EXIT

say "dpkg -i $deb"
dpkg -i "$deb"
[ "$(pkg_status)" = "ii " ] || die "after dpkg -i the status is '$(pkg_status)'"

[ -f "$PLUGIN" ] || die "$PLUGIN is not installed"
[ "$(stat -c '%a %U:%G' "$PLUGIN")" = "644 root:root" ] ||
    die "$PLUGIN has mode/owner $(stat -c '%a %U:%G' "$PLUGIN")"
if command -v nm >/dev/null; then
    nm -D --defined-only "$PLUGIN" | awk '{ print $NF }' | grep -qx CR_PLUGIN_DESC ||
        die "$PLUGIN does not export CR_PLUGIN_DESC"
else
    readelf --dyn-syms -W "$PLUGIN" | awk '$7 != "UND" { print $8 }' | grep -qx CR_PLUGIN_DESC ||
        die "$PLUGIN does not export CR_PLUGIN_DESC"
fi
[ "$(stat -c '%a %U:%G' "$TOOL")" = "755 root:root" ] ||
    die "$TOOL has mode/owner $(stat -c '%a %U:%G' "$TOOL")"
"$TOOL" --version >/dev/null || die "$TOOL --version fails"
"$TOOL" help suspend | grep -q suspend || die "$TOOL help suspend says nothing of suspend"
rc=0
"$TOOL" inspect /nonexistent-criu-gpu-image >/dev/null 2>&1 || rc=$?
[ "$rc" = 1 ] || die "$TOOL inspect of a missing path exits $rc, not 1"
say "$TOOL runs"
# The end-to-end suites loaded target/release/libcriu_gpu_plugin.so (scripts/test.sh keeps a copy
# of it as they found it, in TESTED_PLUGIN): the package must install that very file.
tested=${TESTED_PLUGIN:-target/release/libcriu_gpu_plugin.so}
cmp -s "$PLUGIN" "$tested" ||
    die "$PLUGIN is not byte for byte $tested, the plugin the end-to-end suites tested"
say "$PLUGIN is the plugin the end-to-end suites loaded"
cmp -s "$CONF" packaging/gpu-plugin.conf || die "$CONF differs from packaging/gpu-plugin.conf"
dpkg-query -W -f='${Conffiles}\n' "$PKG" | grep -q "^ $CONF " || die "dpkg does not track $CONF as a conffile"

# Minimal images (Docker's among them) may tell dpkg to leave out documentation.
excluded() { grep -Eqs "^path-exclude[= ]+$1" /etc/dpkg/dpkg.cfg.d/*; }
if [ -f "$DOC/copyright" ] && [ -f "$DOC/changelog.Debian.gz" ]; then
    :
elif excluded /usr/share/doc; then
    say "note: dpkg is configured to leave out /usr/share/doc; not checked"
else
    die "$DOC/copyright or changelog.Debian.gz is not installed"
fi
if [ -f "$MAN" ]; then
    if command -v man >/dev/null; then
        found=$(man -w 7 criu-gpu-plugin) || die "man does not find criu-gpu-plugin(7)"
        [ "$found" = "$MAN" ] || die "man finds criu-gpu-plugin(7) at $found, not $MAN"
        MANWIDTH=80 man --warnings -l "$MAN" >"$work/man.txt" 2>"$work/man.err" ||
            die "man cannot render $MAN: $(cat "$work/man.err")"
        [ ! -s "$work/man.err" ] || die "man warns about $MAN:"$'\n'"$(cat "$work/man.err")"
        grep -q 'CRIU plugin that checkpoints' "$work/man.txt" || die "$MAN renders without its NAME line"
        found=$(man -w 8 criu-gpu) || die "man does not find criu-gpu(8)"
        [ "$found" = "$TOOL_MAN" ] || die "man finds criu-gpu(8) at $found, not $TOOL_MAN"
        MANWIDTH=80 man --warnings -l "$TOOL_MAN" >"$work/man8.txt" 2>"$work/man8.err" ||
            die "man cannot render $TOOL_MAN: $(cat "$work/man8.err")"
        [ ! -s "$work/man8.err" ] || die "man warns about $TOOL_MAN:"$'\n'"$(cat "$work/man8.err")"
        say "manual pages render without warnings"
    else
        say "note: no man (man-db) here; the manual page was not rendered"
    fi
elif excluded /usr/share/man; then
    say "note: dpkg is configured to leave out /usr/share/man; not checked"
else
    die "$MAN is not installed"
fi

# CRIU loads it from its built-in directory: no --libdir, no CRIU_LIBS_DIR, no config file.
if [ -x "$CRIU_BIN" ]; then
    setsid sleep 600 </dev/null >/dev/null 2>&1 &
    sleeper=$!
    disown "$sleeper" # CRIU's dump ends it: no "Killed" report from bash
    sleep 0.3
    mkdir "$work/img"
    env -u CRIU_LIBS_DIR -u CRIU_GPU_PLUGIN_CONFIG "$CRIU_BIN" dump --no-default-config \
        -t "$sleeper" -D "$work/img" -v4 -o "$work/dump.log" ||
        die "criu dump with the installed plugin failed; log:"$'\n'"$(tail -n 30 "$work/dump.log")"
    sleeper=""
    grep -q "gpu_plugin: gpu_plugin $upstream in CRIU" "$work/dump.log" ||
        die "CRIU did not load $PLUGIN by default (no gpu_plugin line in its log)"
    grep -q "gpu_plugin: settings from $CONF" "$work/dump.log" ||
        die "the installed plugin did not read $CONF"
    ! grep -E '^(Error|Warn) .*gpu_plugin' "$work/dump.log" ||
        die "the installed plugin logged warnings or errors for a plain process"
    say "CRIU ($CRIU_BIN) loads $PLUGIN by default and reads $CONF"
else
    say "note: no CRIU at $CRIU_BIN; the default-directory load was not checked"
fi

# The container test against the installed plugin. Same flags as scripts/test.sh's cargo test,
# so that its build is reused.
say "cargo test --test e2e_containers runc_installed_plugin"
CRIU_GPU_TEST_INSTALLED_PLUGIN=$PLUGIN \
    cargo test --workspace --all-features --locked --test e2e_containers runc_installed_plugin \
    -- --nocapture 2>&1 | tee "$work/cargo-test.log"
# A filter that matches no test passes too: insist that one ran.
grep -Eq 'test result: ok\. [1-9][0-9]* passed' "$work/cargo-test.log" ||
    die "runc_installed_plugin did not run (no test matched)"

# --- Purged -------------------------------------------------------------------------------------
say "dpkg --purge $PKG"
dpkg --purge "$PKG"
! is_known || die "after the purge dpkg still knows $PKG (status '$(pkg_status)')"
for f in "$PLUGIN" "$CONF" "$MAN" "$TOOL" "$TOOL_MAN" "$DOC/copyright" "/usr/share/lintian/overrides/$PKG"; do
    [ ! -e "$f" ] || die "$f is left after the purge"
done
for d in /etc/criu /usr/lib/criu "$DOC"; do
    existed_before "$d" || [ ! -e "$d" ] || die "$d was made by the package and is left after the purge"
done
say "purged; nothing left"
say "ok"
