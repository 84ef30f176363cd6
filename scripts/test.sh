#!/usr/bin/env bash
# The whole test suite: formatting, lints, docs, generated code, then every unit, integration and
# end-to-end test of the workspace (end-to-end tests run the real criu from
# scripts/install-criu.sh against real processes and real container runtimes, and need root),
# then the Debian package. Fails on the first failure.
set -euo pipefail
REPO=$(cd "$(dirname "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)
cd "$REPO"
scripts/setup.sh
export CRIU_BIN="$REPO/.criu/bin/criu"
echo "[test] cargo fmt --check"
cargo fmt --all --check
echo "[test] cargo clippy"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
echo "[test] cargo doc"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked
echo "[test] generated code is current"
scripts/check-generated.sh
echo "[test] code references in the docs resolve"
scripts/check-doc-refs.sh
echo "[test] the release plugin (every end-to-end suite runs real CRIU with it)"
cargo build --release --locked -p criu-gpu-plugin --lib
so=target/release/libcriu_gpu_plugin.so
tested=$(mktemp)
trap 'rm -f "$tested"' EXIT
cp "$so" "$tested"
# scripts/package-deb.sh's build (the plugin with criu-gpu, one cargo run) must make the same
# file: the suites test the .so the package ships.
cargo build --release --locked -p criu-gpu-plugin -p criu-gpu
cmp "$so" "$tested" || { echo "[test] $so built as the package builds it differs from the tested one" >&2; exit 1; }
echo "[test] cargo test"
cargo test --workspace --all-features --locked
cmp "$so" "$tested" || { echo "[test] cargo test changed $so" >&2; exit 1; }
# The end-to-end suites (real CRIU against real processes and runtimes) once more against each
# newer CRIU release.
for release in 4.2.1 4.3; do
    echo "[test] end-to-end suites against CRIU $release"
    CRIU_BIN="$REPO/.criu-$release/bin/criu" cargo test --all-features --locked \
        --test e2e_criu --test e2e_cuda_fake --test e2e_cuda_settings --test e2e_cuda_restore_state \
        --test e2e_cut_short --test e2e_criu_4_3 --test kfd_seccomp --test e2e_containers \
        --test e2e_containers_2026 --test e2e_cri --test e2e_gpu_containers
done
echo "[test] Debian package: build, install, container test with the installed plugin, purge"
scripts/test-deb.sh
