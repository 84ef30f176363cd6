//! Parallel restore of BO contents: restored tasks hand the copy to CRIU's main process
//! (CRIU 4.2 and later), which does it at the first `RESUME_DEVICES_LATE` (or at `exit`, when
//! the restore failed before that). No thread serves the queue between hooks: CRIU enters the
//! restored tree's mount namespace after `POST_FORKING`, and the kernel refuses that to a
//! multi-threaded process ([`criu_plugin::criu_internals::MOUNT_NS_ENTERED_AFTER_POST_FORKING`]).
//!
//! The C plugin does this over an abstract UNIX socket (which breaks when a task already
//! lives in another network namespace, and reads it with single `recv`s, which a stream
//! socket may answer short when there are many BOs). Here the request travels through shared
//! memory mapped before CRIU forks ([`queue::RestoreQueue`]), with a futex to wake a waiting
//! server, and the dma-buf fds through CRIU's fdstore, a service socket
//! every restore process keeps. Nothing is bound to a name or a namespace, and a request is
//! never read partially. Offsets in the pages files come from each GPU's own layout (the C
//! plugin sums them over all GPUs, so a second GPU's reads miss its data), and the main
//! process closes every fd it receives (the C plugin keeps them open until CRIU exits).
//!
//! A task that cannot hand its copy over (no POST_FORKING on this host, the queue is full, the fdstore
//! refuses an fd) does the copy itself, as without parallel restore.
//!
//! Parts: [`fdstore`] (how fds pass between restore processes), [`queue`] (the request
//! queue in shared memory and its futex), [`keys`] (the table of published dma-bufs) and
//! [`handover`] (what a task hands over, and CRIU's main process serving it).

mod fdstore;
mod handover;
mod keys;
mod queue;

pub use fdstore::{CriuFdStore, FdStore, LocalFdStore};
pub use handover::Handover;
pub use queue::{MAX_REQUESTS, QueueOutcome};

#[cfg(test)]
mod tests {
    /// Waits for the child of `fork` (the parent's side) and checks it exited with 0.
    pub(super) fn exited_zero(fork: nix::unistd::ForkResult) {
        let nix::unistd::ForkResult::Parent { child } = fork else {
            unreachable!("only the parent gets here");
        };
        let st = nix::sys::wait::waitpid(child, None).unwrap();
        assert_eq!(st, nix::sys::wait::WaitStatus::Exited(child, 0));
    }
}
