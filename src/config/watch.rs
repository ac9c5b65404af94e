//! Watches the configuration file for changes. It watches the file's directory, not
//! the file: editors save by writing a temporary file and renaming it over the old
//! one, and Kubernetes swaps a `..data` symlink, and a watch on the file itself
//! would lose track after the first such save. When the path is a symlink, the
//! directory of the file it points to is watched too. Bursts of events are
//! debounced; what to do then (read the file, compare its hash, reload) is the
//! caller's.

use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// How long the directory must stay quiet before a change is reported.
pub const DEBOUNCE: Duration = Duration::from_millis(200);

/// A running watch; dropping it stops watching.
pub struct Watch {
    _watcher: RecommendedWatcher,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Calls `changed` once a burst of events in the directories of `path` has been
/// quiet for `DEBOUNCE`. Events about other files of the directory trigger it too
/// (a symlink swap touches only `..data`): the caller compares the file's content.
pub fn watch(path: &Path, changed: impl Fn() + Send + 'static) -> Result<Watch, notify::Error> {
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        // Access events (open, read) change nothing.
        if ev.is_ok_and(|e| !e.kind.is_access()) {
            let _ = tx.send(());
        }
    })?;
    for dir in directories(path) {
        watcher.watch(&dir, RecursiveMode::NonRecursive)?;
        tracing::debug!(dir = %dir.display(), "watching for configuration changes");
    }
    let task = tokio::spawn(async move {
        while rx.recv().await.is_some() {
            // Wait for the burst to end: every event restarts the quiet period.
            loop {
                match tokio::time::timeout(DEBOUNCE, rx.recv()).await {
                    Ok(Some(())) => continue,
                    Ok(None) => return,
                    Err(_) => break,
                }
            }
            changed();
        }
    });
    Ok(Watch {
        _watcher: watcher,
        task,
    })
}

/// The directory of `path`, and of the file it resolves to when that differs.
fn directories(path: &Path) -> Vec<PathBuf> {
    let dir = |p: &Path| match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut dirs = vec![dir(path)];
    if let Ok(real) = std::fs::canonicalize(path) {
        let real_dir = dir(&real);
        let same = std::fs::canonicalize(&dirs[0]).is_ok_and(|d| d == real_dir);
        if !same {
            dirs.push(real_dir);
        }
    }
    dirs
}
