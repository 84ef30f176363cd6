# shellcheck shell=bash
# Sourced by the install scripts: a private apt setup for one or more Debian suites, with its
# own source list, lists, cache, pin preferences and an empty dpkg status, so that the system's
# apt state (sources, lists, status, preferences.d pins) is neither read for resolution nor
# written. The system's apt.conf.d still applies (proxies etc.); appstream metadata and update
# hooks from there are cleared because they would act on the system.
#
#   private_apt WORK SUITES MIRROR KEYRING  writes WORK/apt/{sources.list,preferences,apt.conf}
#                                           and the directories apt needs; SUITES is one suite
#                                           or a space-separated list ("trixie sid experimental")
#   private_apt_pin PACKAGES PIN PRIORITY   appends a pin to the private preferences, e.g.
#                                           private_apt_pin "criu libcompel1" "version 4.3-1~exp2" 1001
#                                           (call after private_apt)
#   private_apt_preflight PREFIX KEYRING WHY
#                                           refuses a PREFIX this did not create (no VERSION
#                                           stamp, not empty), and needs apt's tools and KEYRING
#                                           (WHY ends the message); the caller defines die
#   apt_ TOOL ARGS...                       runs apt-get / apt-cache with that setup
#                                           (needs $PRIVATE_APT_CONF, set by private_apt)

private_apt() {
    local work=$1 suites=$2 mirror=$3 keyring=$4 suite
    mkdir -p "$work/apt/lists/partial" "$work/apt/cache/archives/partial"
    : >"$work/apt/sources.list"
    for suite in $suites; do
        echo "deb [signed-by=$keyring] $mirror $suite main" >>"$work/apt/sources.list"
    done
    : >"$work/apt/preferences"
    cat >"$work/apt/apt.conf" <<CONF
Dir::Etc::SourceList "$work/apt/sources.list";
Dir::Etc::SourceParts "/dev/null";
Dir::Etc::Preferences "$work/apt/preferences";
Dir::Etc::PreferencesParts "/dev/null";
Dir::State::Lists "$work/apt/lists";
Dir::State::status "/dev/null";
Dir::Cache "$work/apt/cache";
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
APT::Architecture "amd64";
APT::Architectures { "amd64"; };
APT::Sandbox::User "root";
Acquire::Languages "none";
#clear Acquire::IndexTargets::deb::DEP-11;
#clear Acquire::IndexTargets::deb::DEP-11-icons;
#clear Acquire::IndexTargets::deb::DEP-11-icons-small;
#clear Acquire::IndexTargets::deb::DEP-11-icons-large;
#clear Acquire::IndexTargets::deb::DEP-11-icons-hidpi;
#clear Acquire::IndexTargets::deb::DEP-11-icons-large-hidpi;
#clear APT::Update::Pre-Invoke;
#clear APT::Update::Post-Invoke;
#clear APT::Update::Post-Invoke-Success;
CONF
    PRIVATE_APT_CONF=$work/apt/apt.conf
    PRIVATE_APT_PREFS=$work/apt/preferences
}

private_apt_pin() {
    local packages=$1 pin=$2 priority=$3
    if [ -s "$PRIVATE_APT_PREFS" ]; then echo >>"$PRIVATE_APT_PREFS"; fi
    printf 'Package: %s\nPin: %s\nPin-Priority: %s\n' "$packages" "$pin" "$priority" >>"$PRIVATE_APT_PREFS"
}

# Given with -c, the file is read after apt.conf.d, so its #clear lines take effect.
apt_() { local tool=$1; shift; "$tool" -c "$PRIVATE_APT_CONF" "$@"; }

private_apt_preflight() {
    local prefix=$1 keyring=$2 why=$3
    # Refuse to delete a folder we did not create.
    if [ -e "$prefix" ] && [ ! -f "$prefix/VERSION" ] && [ -n "$(ls -A "$prefix" 2>/dev/null)" ]; then
        die "$prefix exists but has no VERSION stamp; remove it yourself if it is disposable"
    fi
    command -v apt-get >/dev/null && command -v apt-cache >/dev/null && command -v dpkg >/dev/null \
        || die "apt-get, apt-cache and dpkg are needed$why (run this on Debian/Ubuntu)"
    [ -r "$keyring" ] || die "$keyring not found; install the 'debian-archive-keyring' package"
}
