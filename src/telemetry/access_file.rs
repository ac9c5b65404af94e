//! The access log's file (`access_log.path`): lines gathered in a buffer and
//! written when it is full or `flush` after, as nginx's `buffer=` and `flush=`;
//! opened again on SIGUSR1 (logrotate's `postrotate`), with every line written
//! before the reopen in the old file and every line after it in the new one.
//!
//! Two locks, always taken in this order: `pending` (the lines not yet written,
//! held while one line is appended) and `out` (the file and a spare buffer, held
//! while a full buffer is written). A writer swaps the full buffer with the spare
//! under both, then lets `pending` go before the write itself, so requests append
//! to the fresh buffer meanwhile and the lines still reach the file in order.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

/// How the file is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileOptions {
    pub path: PathBuf,
    /// Bytes gathered before a write; 0 writes each line at once.
    pub buffer: usize,
    /// The longest a line waits in the buffer.
    pub flush: Duration,
}

/// An open access log file.
pub struct AccessFile {
    options: FileOptions,
    pending: Mutex<Vec<u8>>,
    out: Mutex<Out>,
    /// The second of the last warning about a failed write (at most one a second).
    warned_at: AtomicU64,
}

struct Out {
    file: File,
    spare: Vec<u8>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn open(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
}

impl AccessFile {
    /// Opens (or creates) the file for appending, and starts the thread that
    /// flushes it every `flush`; the thread ends after the file is dropped.
    pub fn open(options: FileOptions) -> std::io::Result<Arc<AccessFile>> {
        let file = open(&options.path)?;
        let capacity = options.buffer + 1024;
        let f = Arc::new(AccessFile {
            pending: Mutex::new(Vec::with_capacity(capacity)),
            out: Mutex::new(Out {
                file,
                spare: Vec::with_capacity(capacity),
            }),
            options,
            warned_at: AtomicU64::new(0),
        });
        let weak: Weak<AccessFile> = Arc::downgrade(&f);
        let every = f.options.flush.max(Duration::from_millis(1));
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || loop {
                std::thread::sleep(every);
                match weak.upgrade() {
                    Some(f) => f.flush(),
                    None => return,
                }
            })?;
        Ok(f)
    }

    pub fn options(&self) -> &FileOptions {
        &self.options
    }

    /// Appends `line` and a newline; writes the buffer when that fills it.
    pub fn append(&self, line: &[u8]) {
        let mut pending = lock(&self.pending);
        pending.extend_from_slice(line);
        pending.push(b'\n');
        if pending.len() >= self.options.buffer {
            self.write_out(pending);
        }
    }

    /// Writes whatever is buffered.
    pub fn flush(&self) {
        let pending = lock(&self.pending);
        if !pending.is_empty() {
            self.write_out(pending);
        }
    }

    /// Writes what is buffered to the file open now, then opens the path again
    /// (a new file if the old one was moved away). If it cannot be opened, the old
    /// file stays in use.
    pub fn reopen(&self) {
        let mut pending = lock(&self.pending);
        let mut out = lock(&self.out);
        Self::write_buffer(&self.warned_at, &self.options.path, &mut out, &mut pending);
        match open(&self.options.path) {
            Ok(file) => {
                out.file = file;
                tracing::info!(path = %self.options.path.display(), "access log reopened");
            }
            Err(e) => {
                tracing::error!(path = %self.options.path.display(), error = %e, "cannot reopen the access log; writing on to the file open before");
            }
        }
    }

    /// Swaps the buffer for the spare and writes it, `pending` released before
    /// the write.
    fn write_out(&self, mut pending: MutexGuard<'_, Vec<u8>>) {
        let mut out = lock(&self.out);
        let out = &mut *out;
        std::mem::swap(&mut *pending, &mut out.spare);
        drop(pending);
        let mut full = std::mem::take(&mut out.spare);
        Self::write_buffer(&self.warned_at, &self.options.path, out, &mut full);
        out.spare = full;
    }

    /// Writes `buf` to the file and empties it.
    fn write_buffer(warned_at: &AtomicU64, path: &Path, out: &mut Out, buf: &mut Vec<u8>) {
        if buf.is_empty() {
            return;
        }
        if let Err(e) = out.file.write_all(buf) {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            if warned_at.swap(now, Relaxed) != now {
                tracing::warn!(path = %path.display(), error = %e, bytes = buf.len(), "access log lines lost: cannot write the file");
            }
        }
        buf.clear();
    }
}

impl Drop for AccessFile {
    fn drop(&mut self) {
        self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_wait_for_a_full_buffer_then_go_in_order_and_a_reopen_splits_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.log");
        let f = AccessFile::open(FileOptions {
            path: path.clone(),
            buffer: 16,
            flush: Duration::from_secs(3600),
        })
        .unwrap();
        let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
        f.append(b"one");
        f.append(b"two");
        assert_eq!(read(&path), "");
        f.append(b"three-four-five");
        assert_eq!(read(&path), "one\ntwo\nthree-four-five\n");
        f.append(b"six");
        let moved = dir.path().join("access.log.1");
        std::fs::rename(&path, &moved).unwrap();
        f.reopen();
        f.append(b"seven");
        drop(f);
        assert_eq!(read(&moved), "one\ntwo\nthree-four-five\nsix\n");
        assert_eq!(read(&path), "seven\n");
    }
}
