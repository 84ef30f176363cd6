//! A [`CopyObserver`] that keeps what a backend copied, for tests and benchmarks to look at.

use std::sync::Mutex;

use criu_gpu_core::amdgpu::{CopyObserver, CopyRecord};

/// Every BO content copy told to it, in order.
#[derive(Default)]
pub struct CopyLog(Mutex<Vec<CopyRecord>>);

impl CopyLog {
    /// The copies told since the last call, oldest first; the log is empty afterwards.
    pub fn take(&self) -> Vec<CopyRecord> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl CopyObserver for CopyLog {
    fn copied(&self, record: CopyRecord) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(record);
    }
}
