//! Passing fds between CRIU's restore processes: CRIU's fdstore, a service socket every
//! restore process keeps, or a stand-in inside one process for tests and tools.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Mutex;

/// Passes fds between CRIU's restore processes.
pub trait FdStore: Send + Sync {
    /// Stores a copy of `fd`; returns its id.
    fn add(&self, fd: BorrowedFd<'_>) -> io::Result<i32>;
    /// A new fd for the file stored under `id`.
    fn get(&self, id: i32) -> io::Result<OwnedFd>;
    /// Forgets every stored fd, at the end of a restore (CRIU's fdstore goes with CRIU).
    fn clear(&self) {}
}

/// CRIU's fdstore (`fdstore_add`/`fdstore_get`, resolved at run time by `criu_plugin`).
pub struct CriuFdStore {
    syms: &'static criu_plugin::CriuSymbols,
}

impl CriuFdStore {
    /// The fdstore of the CRIU that loaded the plugin, if there is one.
    pub fn resolve() -> Option<CriuFdStore> {
        let syms = criu_plugin::CriuSymbols::get();
        syms.has_fdstore().then_some(CriuFdStore { syms })
    }
}

impl FdStore for CriuFdStore {
    fn add(&self, fd: BorrowedFd<'_>) -> io::Result<i32> {
        self.syms.fdstore_add(fd)
    }

    fn get(&self, id: i32) -> io::Result<OwnedFd> {
        self.syms.fdstore_get(id)
    }
}

/// An fdstore inside one process (no CRIU; tests and tools).
#[derive(Default)]
pub struct LocalFdStore {
    fds: Mutex<Vec<OwnedFd>>,
}

impl FdStore for LocalFdStore {
    fn add(&self, fd: BorrowedFd<'_>) -> io::Result<i32> {
        let copy = fd.try_clone_to_owned()?;
        let mut fds = self.fds.lock().unwrap_or_else(|e| e.into_inner());
        fds.push(copy);
        Ok((fds.len() - 1) as i32)
    }

    fn get(&self, id: i32) -> io::Result<OwnedFd> {
        let fds = self.fds.lock().unwrap_or_else(|e| e.into_inner());
        let fd = usize::try_from(id)
            .ok()
            .and_then(|i| fds.get(i))
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        fd.try_clone()
    }

    fn clear(&self) {
        self.fds.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn the_local_fdstore_hands_out_copies() {
        let store = LocalFdStore::default();
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        use std::os::fd::AsFd;
        let id = store.add(a.as_fd()).unwrap();
        drop(a);
        let c = store.get(id).unwrap();
        assert!(c.as_raw_fd() >= 0);
        assert!(store.get(id + 1).is_err());
    }
}
