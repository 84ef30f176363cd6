# Sourced by the install scripts: a private apt setup for one Debian suite, with its own source
# list, lists, cache and an empty dpkg status, so that the system's apt state is neither read
# for resolution nor written. The system's apt.conf.d still applies (proxies etc.); appstream
# metadata and update hooks from there are cleared because they would act on the system.
#
#   private_apt WORK SUITE MIRROR KEYRING   writes WORK/apt/{sources.list,apt.conf} and the
#                                           directories apt needs
#   apt_ TOOL ARGS...                       runs apt-get / apt-cache with that setup
#                                           (needs $PRIVATE_APT_CONF, set by private_apt)

private_apt() {
    local work=$1 suite=$2 mirror=$3 keyring=$4
    mkdir -p "$work/apt/lists/partial" "$work/apt/cache/archives/partial"
    echo "deb [signed-by=$keyring] $mirror $suite main" >"$work/apt/sources.list"
    cat >"$work/apt/apt.conf" <<CONF
Dir::Etc::SourceList "$work/apt/sources.list";
Dir::Etc::SourceParts "/dev/null";
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
}

# Given with -c, the file is read after apt.conf.d, so its #clear lines take effect.
apt_() { local tool=$1; shift; "$tool" -c "$PRIVATE_APT_CONF" "$@"; }
