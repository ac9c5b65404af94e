//! Configuration: `rules.yaml` is read into the raw `schema` types, checked by
//! `validate` (every error with file, line and column), and turned by `compile` into
//! the runtime structures the request path reads through one `Arc`.

pub mod compile;
pub mod locate;
pub mod schema;
pub mod summary;
pub mod validate;
pub mod value;
pub mod watch;

use std::fmt;
use std::path::{Path, PathBuf};

/// One problem in a configuration file, located at the node that causes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    /// 1-based; 0 when the problem has no place in the file (e.g. it cannot be read).
    pub line: usize,
    /// 1-based.
    pub col: usize,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file.display(), self.message)
        } else {
            write!(
                f,
                "{}:{}:{}: {}",
                self.file.display(),
                self.line,
                self.col,
                self.message
            )
        }
    }
}

impl std::error::Error for ConfigError {}

/// All problems found in one file, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// A parsed and validated configuration file.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub path: PathBuf,
    pub file: schema::File,
    /// Hex SHA-1 of the file's bytes: names this version in logs and `/admin/config`.
    pub hash: String,
}

/// The path `sluice run`/`check` use without `-c`: `$SLUICE_CONFIG`, then
/// `config/rules.yaml`.
pub fn default_path() -> PathBuf {
    std::env::var_os("SLUICE_CONFIG")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("config/rules.yaml"))
}

pub fn load(path: &Path) -> Result<Loaded, ConfigErrors> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        ConfigErrors(vec![ConfigError {
            file: path.to_path_buf(),
            line: 0,
            col: 0,
            message: format!("cannot read: {e}"),
        }])
    })?;
    parse(&text, path)
}

/// Parse and validate `text` as if read from `path`.
/// Hex SHA-1 of a configuration file's text: names a version of it.
pub fn hash(text: &str) -> String {
    sha1_smol::Sha1::from(text.as_bytes()).digest().to_string()
}

pub fn parse(text: &str, path: &Path) -> Result<Loaded, ConfigErrors> {
    let hash = hash(text);
    // serde_yaml takes a byte order mark (as some Windows editors write) for a
    // document of its own and then reports the real one as a second document.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let index = locate::Index::parse(text);
    let file: schema::File = serde_yaml::from_str(text).map_err(|e| {
        let (mut line, mut col) = e
            .location()
            .map(|l| (l.line(), l.column()))
            .unwrap_or((0, 0));
        let mut message = serde_message(&e, line, col);
        let key_error = message
            .strip_suffix(": data did not match any variant of untagged enum KeySpec")
            .and_then(|route| validate::explain_key_error(text, &index, route));
        if let Some(((l, c), m)) = key_error {
            (line, col, message) = (l, c, m);
        }
        ConfigErrors(vec![ConfigError {
            file: path.to_path_buf(),
            line,
            col,
            message,
        }])
    })?;
    let errors = validate::validate(&file, &index, path);
    if !errors.is_empty() {
        return Err(ConfigErrors(errors));
    }
    Ok(Loaded {
        path: path.to_path_buf(),
        file,
        hash,
    })
}

/// serde_yaml's message without its " at line L column C", which the
/// `FILE:LINE:COL:` prefix already says. A context it adds after a comma (", while
/// parsing a block mapping at line 1 column 1") points elsewhere and stays.
fn serde_message(e: &serde_yaml::Error, line: usize, col: usize) -> String {
    let message = e.to_string();
    message.replacen(&format!(" at line {line} column {col}"), "", 1)
}
