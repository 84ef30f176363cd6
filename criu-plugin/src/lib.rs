//! Safe Rust for CRIU's plugin ABI.
//!
//! A CRIU plugin is a shared object in CRIU's plugin directory that exports one symbol,
//! `CR_PLUGIN_DESC`. This crate provides:
//!
//! - [`abi`]: the descriptor, hook slots and stages exactly as `criu` reads them;
//! - [`host`]: which CRIU loaded the plugin (hook count, `RESTORE_EXT_FILE` arity), found
//!   before CRIU checks the descriptor, so one binary loads in every CRIU from 3.17 to criu-dev;
//! - [`criu_internals`]: every assumption about CRIU's internals beyond the plugin ABI (the
//!   layout of `opts`, its signal handlers and alarm, how it forks, traces and unmaps a
//!   restore's tasks, the order and failure handling of its hooks), each with the CRIU
//!   releases it was checked against;
//! - [`symbols`]: CRIU's own functions and data (logging, image directory, inventory plugin
//!   list, `opts.final_state`, the seize alarm), resolved at run time, never linked;
//! - [`pstree`]: the pids of the tree a restore will create, from `pstree.img`;
//! - [`core_image`]: the CPU architecture a checkpoint's task was dumped on, from its
//!   `core-PID.img`;
//! - [`stream`]: whether CRIU streams its images (`--stream`), for plugins that write files;
//! - [`child`]: work run in a short-lived child process, so that CRIU's own process keeps a
//!   single thread (which `setns(2)` into a container's namespaces needs) and hung calls can be
//!   killed;
//! - [`guardian`]: a process that outlives CRIU and undoes a plugin's work on other processes
//!   when CRIU ends before the plugin could (a signal, a crash, a timeout), and the restore's
//!   duty that ends what CRIU forked ([`guardian::restore`]);
//! - [`proc`]: other processes held by pidfds, start times, bounded `/proc` reads;
//! - [`error`]: a hook's error as one type, [`HookError`]: "not mine", or a [`Failure`]
//!   (positive errno, kind, phase, message, cause) logged once where the hook returns to CRIU;
//! - [`files`]: settings, image and `/proc` files opened without blocking (a FIFO is
//!   refused, not waited on) and read with a bound;
//! - [`options`]: plugin options (`--plugin-option PLUGIN.NAME=VALUE`, CRIU 4.3), looked up at
//!   run time and bounded;
//! - [`threads`]: worker threads for a hook, joined before it returns, with every
//!   asynchronous signal blocked and panics returned as errors;
//! - [`log`]: a `log` backend writing into CRIU's log with CRIU's levels;
//! - [`hooks`]: CRIU's hooks, each declared once in one table, and how a plugin chains a hook
//!   through its handlers;
//! - [`plugin`]: a [`Plugin`] trait with one method per hook, the [`HookHandler`]s (backends) a
//!   plugin forwards hooks to, `extern "C"` trampolines that contain panics and map errors to
//!   negative errno, and [`export_plugin!`]; all generated from the hook table.
//!
//! ```ignore
//! struct MyPlugin;
//! impl criu_plugin::Plugin for MyPlugin { /* ... */ }
//! criu_plugin::export_plugin!(MyPlugin);
//! ```

pub mod abi;
pub mod child;
pub mod core_image;
pub mod criu_internals;
pub mod error;
pub mod fds;
pub mod files;
pub mod guardian;
pub mod hooks;
pub mod host;
mod image_file;
pub mod log;
pub mod options;
pub mod plugin;
pub mod proc;
pub mod pstree;
pub mod stream;
pub mod symbols;
pub mod threads;

pub use abi::HostVersion;
pub use abi::{HookId, PluginDesc, Stage};
pub use error::{Errno, Failure, FailureKind, HookError, HookResult, Phase};
pub use hooks::{Chain, ChainRule};
pub use host::Host;
pub use plugin::{HookHandler, Plugin, VmaUpdate};
pub use symbols::{CriuSymbols, FinalState, InventoryListing};
