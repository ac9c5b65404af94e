//! The memory store's `deny.state_file`: the dynamic entries as a JSON list, loaded
//! at startup and written whole (atomically) when they changed, so that they survive
//! a restart.

use std::path::{Path, PathBuf};

use crate::deny::{now_ms, DenyTable, Entry, EntryJson};

/// The live entries saved at `p` (none if there is no file). A file that does not
/// parse is moved aside to `<p>.corrupt`; either way the gateway starts.
pub fn load(p: &Path) -> DenyTable {
    let mut table = DenyTable::new();
    match read(p) {
        Ok(entries) => {
            let now = now_ms();
            let live: Vec<Entry> = entries
                .into_iter()
                .filter(|e| e.meta.expires_at_ms.is_none_or(|t| t > now))
                .collect();
            tracing::info!(file = %p.display(), entries = live.len(), "dynamic deny entries loaded");
            for e in live {
                table.insert(e);
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
            // Kept for a person to look at: the next change overwrites the file.
            let mut aside = p.as_os_str().to_owned();
            aside.push(".corrupt");
            let moved = std::fs::rename(p, &aside).is_ok();
            tracing::error!(file = %p.display(), error = %e, moved_to = ?moved.then_some(&aside), "deny.state_file not loaded; starting with no dynamic entries")
        }
        Err(e) => {
            tracing::error!(file = %p.display(), error = %e, "deny.state_file cannot be read; starting with no dynamic entries")
        }
    }
    table
}

fn read(p: &Path) -> std::io::Result<Vec<Entry>> {
    let bytes = match std::fs::read(p) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let text = String::from_utf8(bytes)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let list: Vec<EntryJson> = serde_json::from_str(&text)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    Ok(list.into_iter().filter_map(Entry::from_json).collect())
}

/// Temp file in the same directory, fsync, rename: a crash leaves the old file or the
/// new one, never half of one.
pub fn write(p: &Path, list: &[EntryJson]) -> std::io::Result<()> {
    use std::io::Write;
    let body = serde_json::to_vec_pretty(list).map_err(std::io::Error::other)?;
    let mut tmp = p.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&body)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, p)
}
