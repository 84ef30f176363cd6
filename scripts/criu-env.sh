#!/usr/bin/env bash
# Point CRIU_BIN (and CRIU) at the project's private CRIU (see scripts/install-criu.sh).
#
#   source scripts/criu-env.sh        # bash: exports CRIU_BIN and CRIU in this shell
#   eval "$(scripts/criu-env.sh)"     # any shell: same, through the printed exports
#
# An existing CRIU_BIN is kept: it is the override the tests honour first.
# Fails with a hint if CRIU is not installed yet.

if [ -z "${BASH_VERSION:-}" ]; then
    echo 'criu-env: needs bash; from other shells use: eval "$(scripts/criu-env.sh)"' >&2
    return 1 2>/dev/null || exit 1
fi

_criu_env_main() {
    local repo criu
    repo=$(cd "$(dirname "$1")/.." && pwd -P) || return 1
    criu=${CRIU_BIN:-$repo/.criu/bin/criu}
    if [ ! -x "$criu" ]; then
        echo "criu-env: $criu not found; run $repo/scripts/install-criu.sh" >&2
        return 1
    fi
    CRIU_BIN=$criu
    CRIU=$criu
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
    # Sourced.
    _criu_env_main "${BASH_SOURCE[0]}" && export CRIU_BIN CRIU
    _criu_env_rc=$?
    unset -f _criu_env_main
    eval "unset _criu_env_rc; return $_criu_env_rc"
else
    # Executed: print the exports for eval.
    _criu_env_main "$0" || exit 1
    printf 'export CRIU_BIN=%q\nexport CRIU=%q\n' "$CRIU_BIN" "$CRIU"
fi
