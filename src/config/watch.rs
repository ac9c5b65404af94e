//! Watches the configuration file for changes. It watches the file's directory, not
//! the file: editors save by writing a temporary file and renaming it over the old
//! one, and Kubernetes swaps a `..data` symlink, and a watch on the file itself
//! would lose track after the first such save. Only events about the file count:
//! its name, and for a symlink every link on the way to the file it resolves to
//! (`..data`) and that file; whatever else is written in the folder (a log beside
//! it) is ignored, so it never delays a reload. Bursts of events are debounced;
//! what to do then (read the file, compare its hash, reload) is the caller's.

use std::collections::HashSet;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// How long the file must stay quiet before a change is reported.
pub const DEBOUNCE: Duration = Duration::from_millis(200);
/// The longest a burst of events about the file delays its report: a file
/// rewritten without pause is still reloaded, within the promised second.
pub const MAX_DELAY: Duration = Duration::from_millis(800);

/// A running watch; dropping it stops watching.
pub struct Watch {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The paths whose events count, and the directories watched to see them.
struct Paths {
    relevant: HashSet<PathBuf>,
    dirs: Vec<PathBuf>,
}

/// Calls `changed` once a burst of events about `path` has been quiet for
/// `DEBOUNCE` (or has gone on for `MAX_DELAY`). After each report the paths are
/// resolved again: a swapped symlink points elsewhere now.
pub fn watch(path: &Path, changed: impl Fn() + Send + 'static) -> Result<Watch, notify::Error> {
    let path = absolute(path);
    let paths = Arc::new(Mutex::new(resolve(&path)));
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let seen = paths.clone();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        let Ok(ev) = ev else { return };
        // Access events (open, read) change nothing.
        if ev.kind.is_access() {
            return;
        }
        let about_it = {
            let p = seen.lock().unwrap_or_else(PoisonError::into_inner);
            ev.paths.iter().any(|e| p.relevant.contains(e))
        };
        if about_it {
            let _ = tx.send(());
        } else {
            tracing::debug!(paths = ?ev.paths, kind = ?ev.kind, "event ignored: not about the configuration file or a link to it");
        }
    })?;
    let mut watched = Vec::new();
    rewatch(&mut watcher, &mut watched, &paths);
    if watched.is_empty() {
        // Not one directory could be watched: say why.
        let dirs = paths
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .dirs
            .clone();
        for dir in dirs {
            watcher.watch(&dir, RecursiveMode::NonRecursive)?;
            watched.push(dir);
        }
    }
    let task = tokio::spawn(async move {
        while rx.recv().await.is_some() {
            if !burst_ended(&mut rx).await {
                return;
            }
            *paths.lock().unwrap_or_else(PoisonError::into_inner) = resolve(&path);
            rewatch(&mut watcher, &mut watched, &paths);
            changed();
        }
    });
    Ok(Watch { task })
}

/// Waits for a burst of events to end: every event restarts the quiet period, up
/// to `MAX_DELAY` after the first. False when the events' sender is gone.
async fn burst_ended(rx: &mut mpsc::UnboundedReceiver<()>) -> bool {
    let last_chance = Instant::now() + MAX_DELAY;
    loop {
        let quiet = (Instant::now() + DEBOUNCE).min(last_chance);
        match tokio::time::timeout_at(quiet, rx.recv()).await {
            Ok(Some(())) if Instant::now() < last_chance => continue,
            Ok(Some(())) => return true,
            Ok(None) => return false,
            Err(_) => return true,
        }
    }
}

/// Calls `changed` once a burst of events about anything in the folder `dir` (a
/// file written, renamed or removed; Kubernetes' `..data` swapped) has been quiet
/// for `DEBOUNCE`: for a folder of files read together (`rls.config_dir`).
pub fn watch_dir(dir: &Path, changed: impl Fn() + Send + 'static) -> Result<Watch, notify::Error> {
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if ev.is_ok_and(|ev| !ev.kind.is_access()) {
            let _ = tx.send(());
        }
    })?;
    watcher.watch(dir, RecursiveMode::NonRecursive)?;
    let task = tokio::spawn(async move {
        // Held by the task: dropping the watch stops the watcher too.
        let _watcher = watcher;
        while rx.recv().await.is_some() {
            if !burst_ended(&mut rx).await {
                return;
            }
            changed();
        }
    });
    Ok(Watch { task })
}

/// Watches the directories of `paths` that are not watched yet and stops watching
/// those it no longer has.
fn rewatch(watcher: &mut RecommendedWatcher, watched: &mut Vec<PathBuf>, paths: &Mutex<Paths>) {
    let dirs = paths
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .dirs
        .clone();
    watched.retain(|d| {
        let keep = dirs.contains(d);
        if !keep {
            // Gone already, most often (an old ConfigMap version): nothing to say.
            let _ = watcher.unwatch(d);
        }
        keep
    });
    for dir in dirs {
        if watched.contains(&dir) {
            continue;
        }
        match watcher.watch(&dir, RecursiveMode::NonRecursive) {
            Ok(()) => {
                tracing::debug!(dir = %dir.display(), "watching for configuration changes");
                watched.push(dir);
            }
            Err(e) => {
                tracing::debug!(dir = %dir.display(), error = %e, "cannot watch for configuration changes")
            }
        }
    }
}

/// `path` made absolute, without `.` and `..` (a `..` taken lexically: the
/// directories are made canonical later, one link at a time).
fn absolute(path: &Path) -> PathBuf {
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .unwrap_or_else(|_| PathBuf::from("/"))
            .join(path)
    };
    let mut out = PathBuf::new();
    for c in joined.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// `path` as events name it: its directory made canonical (the directory is what
/// is watched), its own name kept.
fn as_watched(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?;
    let dir = std::fs::canonicalize(path.parent()?).ok()?;
    Some(dir.join(name))
}

/// The paths whose events concern `path`: the path itself, and while it is a
/// symlink, every link followed on the way (a link in a directory of the path, as
/// Kubernetes' `..data`, included) and the file it finally resolves to. Their
/// directories are the ones to watch.
fn resolve(path: &Path) -> Paths {
    let mut relevant = HashSet::new();
    let mut at = path.to_path_buf();
    // As the kernel, give up after 40 links (a loop).
    for _ in 0..40 {
        // Links among the directories of `at`, below its first existing ancestor.
        for dir in at.ancestors().skip(1) {
            if std::fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink()) {
                relevant.extend(as_watched(dir));
            }
        }
        relevant.extend(as_watched(&at).or_else(|| Some(at.clone())));
        match std::fs::read_link(&at) {
            Ok(target) => {
                let dir = at.parent().map(Path::to_path_buf).unwrap_or_default();
                at = absolute(&dir.join(target));
            }
            Err(_) => break,
        }
    }
    if let Ok(real) = std::fs::canonicalize(path) {
        relevant.insert(real);
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    for p in &relevant {
        if let Some(d) = p.parent() {
            if d.is_dir() && !dirs.iter().any(|x| x == d) {
                dirs.push(d.to_path_buf());
            }
        }
    }
    dirs.sort();
    Paths { relevant, dirs }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configmap_layout_resolves_to_the_link_its_target_and_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        let d = std::fs::canonicalize(tmp.path()).unwrap();
        std::fs::create_dir(d.join("..v1")).unwrap();
        std::fs::write(d.join("..v1/rules.yaml"), "").unwrap();
        std::fs::write(d.join("access.log"), "").unwrap();
        std::os::unix::fs::symlink("..v1", d.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/rules.yaml", d.join("rules.yaml")).unwrap();
        let p = resolve(&d.join("rules.yaml"));
        let mut relevant: Vec<_> = p.relevant.into_iter().collect();
        relevant.sort();
        assert_eq!(
            relevant,
            [
                d.join("..data"),
                d.join("..v1/rules.yaml"),
                d.join("rules.yaml")
            ]
        );
        assert_eq!(p.dirs, [d.clone(), d.join("..v1")]);
    }

    #[test]
    fn a_plain_file_is_only_itself() {
        let tmp = tempfile::tempdir().unwrap();
        let d = std::fs::canonicalize(tmp.path()).unwrap();
        std::fs::write(d.join("rules.yaml"), "").unwrap();
        let p = resolve(&absolute(&d.join("sub/../rules.yaml")));
        assert_eq!(p.relevant, HashSet::from([d.join("rules.yaml")]));
        assert_eq!(p.dirs, [d]);
    }
}
