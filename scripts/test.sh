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
scripts/check_doc_refs.py
echo "[test] the release plugin (every end-to-end suite runs real CRIU with it)"
cargo build --release --locked -p criu-gpu-plugin --lib
so=target/release/libcriu_gpu_plugin.so
tested=$(mktemp)
trap 'rm -f "$tested"' EXIT
cp "$so" "$tested"
# scripts/package-deb.sh builds criu-gpu after the plugin, in a cargo run of its own: that must
# leave the plugin as it is, the suites testing the .so the package ships (scripts/test-deb.sh
# compares the installed file with this copy).
cargo build --release --locked -p criu-gpu
cmp "$so" "$tested" || { echo "[test] building criu-gpu as the package does changed $so" >&2; exit 1; }
if [ "${GPU_PLUGIN_SKIP_E2E:-0}" != 1 ]; then
    # The Kubernetes suites' cluster (kubelet, kube-apiserver, kubectl, etcd), the runtimes
    # Debian lacks (containerd 2.3 and 2.4, runc 1.5, CRI-O 1.36) and crictl (an operator's
    # pull on a CRI-O node), from their Go modules (docs/upstream.md); about 16 minutes cold on
    # 2 cores, seconds once built. nvidia-ctk is for the GPU machine only.
    echo "[test] upstream programs from their Go modules"
    scripts/build-upstream.sh kubernetes-1.37 etcd-3.7 containerd-2.3 containerd-2.4 runc-1.5 cri-o-1.36 \
        crictl-1.37
fi
echo "[test] cargo test"
cargo test --workspace --all-features --locked
cmp "$so" "$tested" || { echo "[test] cargo test changed $so" >&2; exit 1; }
# The end-to-end suites (real CRIU against real processes and runtimes) once more against each
# newer CRIU release.
for release in 4.2.1 4.3; do
    echo "[test] end-to-end suites against CRIU $release"
    CRIU_BIN="$REPO/.criu-$release/bin/criu" cargo test --all-features --locked \
        --test e2e_criu --test e2e_cuda_fake --test e2e_cuda_fake_failures \
        --test e2e_cuda_settings --test e2e_cuda_restore_state --test e2e_cut_short \
        --test e2e_guardian --test e2e_criu_4_3 --test kfd_seccomp --test e2e_containers --test e2e_containers_2026 \
        --test e2e_cri --test e2e_crio --test e2e_gpu_containers
    # Kubernetes (a kubelet and API server of the test's own) with the newest CRIU only: the
    # workspace run above has them with 4.1.1 (its CUDA cases skip, as the freeze of containerd
    # and CRI-O needs 4.2), and the kubelet adds nothing of its own that a CRIU release changes.
    if [ "$release" = 4.3 ]; then
        CRIU_BIN="$REPO/.criu-$release/bin/criu" cargo test --all-features --locked \
            --test e2e_kubernetes --test e2e_kubernetes_runtimes
    fi
    # criu-gpu against a real CRIU dump: claims (holders gone or stopped, lock directory
    # unusable) and races.
    CRIU_BIN="$REPO/.criu-$release/bin/criu" cargo test --all-features --locked -p criu-gpu \
        --test claims --test race
done
# The cgroup-v2-only guest (scripts/guest/, docs/guest.md): containerd's CRI on a system whose
# cgroup v2 hierarchy has every controller, which this hybrid host cannot give, with each CRIU
# release; Podman 6.1 there with CRIU 4.3. The tests are built here and run in the guest (cargo's
# runner); under QEMU's TCG (no KVM for Debian's kernel here) this block takes about 10 minutes.
guest_why=""
if [ "${GPU_PLUGIN_SKIP_GUEST:-0}" = 1 ]; then
    guest_why="GPU_PLUGIN_SKIP_GUEST=1"
elif [ "${GPU_PLUGIN_SKIP_E2E:-0}" = 1 ]; then
    guest_why="GPU_PLUGIN_SKIP_E2E=1"
elif ! guest_why=$(scripts/guest/run.sh --check); then
    :
else
    guest_why=""
fi
if [ -n "$guest_why" ]; then
    echo "[test] SKIPPED the cgroup-v2-only guest block: $guest_why"
else
    echo "[test] the cgroup-v2-only guest: build"
    guest_t0=$(date +%s)
    scripts/guest/build.sh
    # The CRI test runs criu-gpu, which the guest cannot build.
    cargo build --locked -p criu-gpu
    guest_log="$REPO/target/guest-tests.log"
    guest_test() {
        # $1 CRIU release, then cargo test's arguments: run in the guest, none of them skipped.
        local release=$1
        shift
        echo "[test] in the guest, CRIU $release: $*"
        if ! CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$REPO/scripts/guest/run.sh --" \
            CRIU_BIN="$REPO/.criu-$release/bin/criu" \
            cargo test --all-features --locked "$@" -- --nocapture 2>&1 | tee "$guest_log" \
            | grep --line-buffered -E '^test |^test result|SKIPPED|^\[guest\]|panicked'; then
            # The filter above hides what the tests said: the failures' own words, and the
            # lines before each, end the output.
            echo "[test] FAILED in the guest, CRIU $release: $*; what the failing tests said:" >&2
            grep -B 12 -A 24 -E 'panicked at' "$guest_log" \
                | grep -v -E '/rustc/|rust_begin_unwind|core::panicking|std::|__rust|FnOnce|note: Some details' >&2 || true
            exit 1
        fi
        if grep -q SKIPPED "$guest_log"; then
            echo "[test] ERROR: a test skipped itself in the guest:" >&2
            grep SKIPPED "$guest_log" >&2
            exit 1
        fi
    }
    for release in 4.3 4.2.1; do
        guest_test "$release" --test e2e_cri cri_containerd21_runc14_cgroup2_cuda
    done
    guest_test 4.3 --test e2e_containers_2026 podman61_cgroup2_cuda_export_and_import
    # A kubelet on cgroup v2 (docs/kubernetes.md): the CUDA migration between two nodes, about
    # 10 minutes under TCG.
    guest_test 4.3 --test e2e_kubernetes kubelet_migration_to_node_b_cuda
    # The kernel Debian 12 users run (6.1; the host's is 6.18, the guest above 6.12): the plain
    # suite (CRIU dump and restore with the plugin) with CRIU 4.3, about 2.5 minutes under TCG
    # (docs/guest.md).
    echo "[test] in the Debian 12 guest (kernel 6.1), CRIU 4.3: the plain suite"
    scripts/guest/suites.sh --suite bookworm --criu 4.3 plain
    # The stand-in KFD module (tests/kfd_module, docs/kfd-module.md), built against each guest's
    # kernel: real CRIU dumps and restores a KFD workload through a real /dev/kfd and render
    # nodes (again after a restore, left running, in parallel, onto the GPUs swapped).
    for suite in trixie bookworm; do
        ko_dir="$REPO/target/kfd-module/$suite"
        GUEST_SUITE=$suite scripts/guest/build-module.sh tests/kfd_module "$ko_dir" >/dev/null
        echo "[test] the stand-in KFD module in the $suite guest"
        GUEST_SUITE=$suite KFD_STANDIN_KO="$ko_dir/kfd_standin.ko" GUEST_ENV=KFD_STANDIN_KO \
            guest_test 4.3 --test kfd_module
    done
    # An AMD pod through a kubelet (docs/kubernetes.md), on the module: the kubelet's checkpoint
    # API on node a, the restore on node b from its checkpoint image.
    echo "[test] an AMD pod through the kubelet, in the trixie guest"
    GUEST_SUITE=trixie KFD_STANDIN_KO="$REPO/target/kfd-module/trixie/kfd_standin.ko" GUEST_ENV=KFD_STANDIN_KO \
        guest_test 4.3 --test e2e_kubernetes kubelet_amd_forensic_checkpoint_and_migration
    echo "[test] the cgroup-v2-only guest block took $(( $(date +%s) - guest_t0 )) s"
fi
echo "[test] Debian package: build, install, container test with the installed plugin, purge"
TESTED_PLUGIN="$tested" scripts/test-deb.sh
