//! The tree program (`tests/fixtures/e2e/tree.c`): a parent and a child, each with a thread,
//! four counters written to one file; a restored tree must go on counting where it stopped.

use std::path::PathBuf;

use crate::{E2e, state_of, tree_binary, wait_until};

/// The four counters of a tree, in the order of [`TREE_SOURCES`].
pub type Counters = [u64; 4];
pub const TREE_SOURCES: [&str; 4] = ["parent", "pthread", "child", "cthread"];

/// A running `tree` process tree.
pub struct Tree {
    pub out: PathBuf,
    pub root: i32,
    pub child: i32,
}

impl Tree {
    /// Starts `tree OUT extra...` and waits until every counter has ticked a few times.
    pub fn start(e: &E2e, name: &str, extra: &[&str]) -> Tree {
        let out = e.dir().join(name);
        let mut cmd = e.command(&tree_binary());
        cmd.arg(&out).args(extra);
        let root = e.spawn_session(cmd);
        let mut child = 0;
        wait_until(format!("tree {name} ({root}) ready"), || {
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            let Some(l) = text.lines().find(|l| l.starts_with("ready ")) else {
                return false;
            };
            child = l
                .split_whitespace()
                .find_map(|w| w.strip_prefix("child="))
                .and_then(|v| v.parse().ok())
                .expect("ready line names the child");
            true
        });
        e.adopt(root, child);
        let t = Tree { out, root, child };
        t.wait_ticks(3);
        t
    }

    pub fn pids(&self) -> [i32; 2] {
        [self.root, self.child]
    }

    /// The output's complete lines.
    pub fn text(&self) -> String {
        let mut t = std::fs::read_to_string(&self.out).unwrap_or_default();
        let end = t.rfind('\n').map_or(0, |i| i + 1);
        t.truncate(end);
        t
    }

    /// The restored tree runs again, with the same pids, and goes on from the values it was dumped
    /// with: each counter's first value after the restore is the one after its last value before
    /// (`dumped` = the whole output at the dump, the file not being part of the image).
    pub fn assert_continues(&self, dumped: &str) {
        for pid in self.pids() {
            let st = state_of(pid);
            assert!(
                matches!(st, Some('R' | 'S')),
                "pid {pid} is not running after the restore: {st:?}"
            );
        }
        self.wait_ticks(3);
        let text = self.text();
        let last = last_values(dumped);
        let after = values(&text[dumped.len()..]);
        for (i, src) in TREE_SOURCES.iter().enumerate() {
            assert!(last[i] > 0, "{src} never counted before the dump");
            assert_eq!(
                after[i].first().copied(),
                Some(last[i] + 1),
                "{src}: last value before the dump {}, values after the restore {:?}",
                last[i],
                &after[i][..after[i].len().min(5)]
            );
        }
        assert_consecutive(&text, "the tree's whole output");
    }

    /// Waits until every counter has at least `n` more values than now.
    pub fn wait_ticks(&self, n: usize) {
        let before = self.text().len();
        wait_until(
            format!("{n} more ticks of every task of tree {}", self.root),
            || {
                let text = self.text();
                let vals = values(&text[before.min(text.len())..]);
                vals.iter().all(|v| v.len() >= n)
            },
        );
    }
}

/// Every value of each source in `text`, in file order.
pub fn values(text: &str) -> [Vec<u64>; 4] {
    let mut out: [Vec<u64>; 4] = Default::default();
    for l in text.lines() {
        let Some((src, v)) = l.split_once(' ') else {
            continue;
        };
        if let (Some(i), Ok(v)) = (TREE_SOURCES.iter().position(|s| *s == src), v.parse()) {
            out[i].push(v);
        }
    }
    out
}

/// The last value of each source in `text` (0 where none).
pub fn last_values(text: &str) -> Counters {
    let v = values(text);
    std::array::from_fn(|i| v[i].last().copied().unwrap_or(0))
}

/// Checks that each source's values in `text` go up by exactly one from line to line.
pub fn assert_consecutive(text: &str, what: &str) {
    for (i, vals) in values(text).iter().enumerate() {
        for w in vals.windows(2) {
            assert_eq!(
                w[1],
                w[0] + 1,
                "{what}: {} values jump from {} to {}",
                TREE_SOURCES[i],
                w[0],
                w[1]
            );
        }
    }
}
