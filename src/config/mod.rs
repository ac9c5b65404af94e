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

/// A parsed and validated configuration file.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub path: PathBuf,
    pub file: schema::File,
    /// Hex SHA-1 of the file's bytes: names this version in logs and `/admin/config`.
    pub hash: String,
    /// What `check` warns about, in file order.
    pub warnings: Vec<ConfigWarning>,
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

/// Only the `admin` section of a configuration file, for the admin clients (`deny`,
/// `top`, `fleet`): the rest of the file is not read, so a variable unset there (a
/// gateway's `server.listen` given only where it runs) is no error for them.
pub fn load_admin(path: &Path) -> Result<schema::AdminSpec, ConfigErrors> {
    /// The file with every section but `admin` ignored.
    #[derive(serde::Deserialize)]
    struct AdminOnly {
        #[serde(default)]
        admin: Option<schema::AdminSpec>,
    }
    let errors = |line, col, message| {
        ConfigErrors(vec![ConfigError {
            file: path.to_path_buf(),
            line,
            col,
            message,
        }])
    };
    let text =
        std::fs::read_to_string(path).map_err(|e| errors(0, 0, format!("cannot read: {e}")))?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    match serde_yaml::from_str::<AdminOnly>(text) {
        Ok(file) => Ok(file.admin.unwrap_or_default()),
        Err(e) => {
            let (line, col) = e
                .location()
                .map(|l| (l.line(), l.column()))
                .unwrap_or((0, 0));
            Err(errors(line, col, serde_message(&e, line, col)))
        }
    }
}

/// Hex SHA-1 of a configuration file's text: names a version of it.
pub fn hash(text: &str) -> String {
    sha1_smol::Sha1::from(text.as_bytes()).digest().to_string()
}

/// Parse and validate `text` as if read from `path`.
pub fn parse(text: &str, path: &Path) -> Result<Loaded, ConfigErrors> {
    let hash = hash(text);
    // serde_yaml takes a byte order mark (as some Windows editors write) for a
    // document of its own and then reports the real one as a second document.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let index = locate::Index::parse(text);
    let file: schema::File = serde_yaml::from_str(text).map_err(|e| {
        let (line, col) = e
            .location()
            .map(|l| (l.line(), l.column()))
            .unwrap_or((0, 0));
        let message = serde_message(&e, line, col);
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
    let warnings = validate::warnings(&file, &index, path);
    Ok(Loaded {
        path: path.to_path_buf(),
        file,
        hash,
        warnings,
    })
}

/// The JSON Schema of the configuration file (`sluice schema`), derived from the
/// types the parser reads it into, as pretty JSON ending in a newline.
pub fn json_schema() -> String {
    let mut schema = schemars::schema_for!(schema::File);
    schema.insert("title".into(), "sluice rules.yaml".into());
    schema.insert(
        "description".into(),
        "The configuration of sluice, a rate-limiting reverse proxy. Generated by `sluice schema`."
            .into(),
    );
    let mut schema = schema.to_value();
    allow_empty_sections(&mut schema);
    let mut out = serde_json::to_string_pretty(&schema).unwrap_or_default();
    out.push('\n');
    out
}

/// The parser reads a section written empty (`server:` with every line under it
/// commented out: YAML's null) as an empty mapping or list, its defaults; so the
/// schema lets every field whose value is a mapping or a list be null too.
fn allow_empty_sections(schema: &mut serde_json::Value) {
    use serde_json::{json, Map, Value};
    /// The field's value is a mapping or a list: also null.
    fn nullable(field: &mut Map<String, Value>, mappings: &[String]) {
        if let Some(t @ ("object" | "array")) = field.get("type").and_then(Value::as_str) {
            let t = json!([t, "null"]);
            field.insert("type".into(), t);
        } else if field
            .get("$ref")
            .and_then(Value::as_str)
            .is_some_and(|r| mappings.iter().any(|m| m == r))
        {
            let r = field.remove("$ref");
            field.insert("anyOf".into(), json!([{"$ref": r}, {"type": "null"}]));
        }
    }
    fn walk(v: &mut Value, mappings: &[String]) {
        match v {
            Value::Object(map) => {
                if let Some(Value::Object(props)) = map.get_mut("properties") {
                    let fields = props.values_mut().filter_map(Value::as_object_mut);
                    fields.for_each(|f| nullable(f, mappings));
                }
                map.values_mut().for_each(|v| walk(v, mappings));
            }
            Value::Array(items) => items.iter_mut().for_each(|v| walk(v, mappings)),
            _ => {}
        }
    }
    // `$ref`s to the definitions that are mappings.
    let mappings: Vec<String> = schema["$defs"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, d)| d["type"] == "object")
        .map(|(name, _)| format!("#/$defs/{name}"))
        .collect();
    walk(schema, &mappings);
}

/// serde_yaml's message without its " at line L column C", which the
/// `FILE:LINE:COL:` prefix already says. A context it adds after a comma (", while
/// parsing a block mapping at line 1 column 1") points elsewhere and stays.
fn serde_message(e: &serde_yaml::Error, line: usize, col: usize) -> String {
    let message = e.to_string();
    message.replacen(&format!(" at line {line} column {col}"), "", 1)
}
