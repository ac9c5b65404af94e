//! What a configuration file is wrong about: its errors, each at the node that
//! causes it, and its warnings.

use std::fmt;
use std::path::PathBuf;

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

/// A setting that is valid but that any client can defeat: `check` prints it and
/// still exits 0; `run` and every reload log it at WARN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigWarning(pub ConfigError);

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let e = &self.0;
        write!(
            f,
            "{}:{}:{}: warning: {}",
            e.file.display(),
            e.line,
            e.col,
            e.message
        )
    }
}

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
