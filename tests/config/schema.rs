//! `sluice schema` and `config/rules.schema.json`: the file in the repository is what
//! the binary prints, every configuration file in the repository says so in its
//! first line (the yaml-language-server modeline, so editors complete and check it)
//! and passes the schema, and the schema and the parser agree on what they refuse.
//!
//! The validator is boon, a JSON Schema 2020-12 implementation of its own: the
//! schema is checked by code that did not write it.

use std::path::{Path, PathBuf};
use std::process::Command;

const SCHEMA_FILE: &str = "config/rules.schema.json";
const MODELINE: &str = "# yaml-language-server: $schema=";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn printed_schema() -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("schema")
        .output()
        .unwrap();
    assert!(out.status.success(), "sluice schema: {out:?}");
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

struct Validator {
    schemas: boon::Schemas,
    index: boon::SchemaIndex,
}

impl Validator {
    fn new() -> Validator {
        let schema: serde_json::Value = serde_json::from_str(&printed_schema()).unwrap();
        let mut schemas = boon::Schemas::new();
        let mut compiler = boon::Compiler::new();
        compiler
            .add_resource("file:///rules.schema.json", schema)
            .unwrap();
        let index = compiler
            .compile("file:///rules.schema.json", &mut schemas)
            .unwrap_or_else(|e| panic!("the schema does not compile: {e:#}"));
        Validator { schemas, index }
    }

    /// The schema's complaints about `yaml`, or `Ok`.
    fn check(&self, yaml: &str) -> Result<(), String> {
        let value: serde_json::Value = serde_yaml::from_str(yaml).map_err(|e| e.to_string())?;
        self.schemas
            .validate(&value, self.index)
            .map_err(|e| format!("{e:#}"))
    }
}

#[test]
fn the_file_in_the_repository_is_what_sluice_schema_prints() {
    let kept = std::fs::read_to_string(root().join(SCHEMA_FILE)).unwrap();
    assert!(
        kept == printed_schema(),
        "{SCHEMA_FILE} is stale: regenerate it with `cargo run -q -- schema > {SCHEMA_FILE}`"
    );
}

#[test]
fn the_schema_knows_every_section_and_refuses_what_it_does_not_know() {
    let schema: serde_json::Value = serde_json::from_str(&printed_schema()).unwrap();
    assert_eq!(
        schema["$schema"],
        "https://json-schema.org/draft/2020-12/schema"
    );
    let mut top: Vec<&str> = schema["properties"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    top.sort_unstable();
    assert_eq!(
        top,
        [
            "access_log",
            "admin",
            "client_ip",
            "deny",
            "jwt",
            "response_headers",
            "rls",
            "routes",
            "server",
            "store",
            "upstreams"
        ]
    );
    assert_eq!(schema["required"], serde_json::json!(["routes"]));
    // Every object of the file is closed, as the parser's `deny_unknown_fields`.
    for (name, def) in schema["$defs"].as_object().unwrap() {
        if def["type"] == "object" && def.get("properties").is_some() {
            assert_eq!(def["additionalProperties"], false, "$defs/{name}");
        }
    }
}

/// Every YAML file in the repository that configures sluice: one with a top-level
/// `routes:`.
fn config_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries {
            let path = e.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                if !name.starts_with('.')
                    && !["target", "node_modules", "fuzz"].contains(&name.as_str())
                {
                    walk(&path, out);
                }
            } else if name.ends_with(".yaml") || name.ends_with(".yml") {
                let text = std::fs::read_to_string(&path).unwrap();
                if text.lines().any(|l| l.starts_with("routes:")) {
                    out.push(path);
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(&root(), &mut out);
    out.sort();
    out
}

#[test]
fn every_configuration_file_names_the_schema_and_passes_it() {
    let files = config_files();
    let named = |p: &str| files.iter().any(|f| f.ends_with(p));
    assert!(
        named("config/rules.yaml") && named("config/redis.yaml"),
        "{files:?}"
    );
    assert!(
        named("tests/fixtures/config/spec_example.yaml"),
        "{files:?}"
    );
    let validator = Validator::new();
    let schema_file = root().join(SCHEMA_FILE).canonicalize().unwrap();
    for file in &files {
        let shown = file.strip_prefix(root()).unwrap().display();
        let text = std::fs::read_to_string(file).unwrap();
        // The modeline, first, with a path that leads to the schema from the file's
        // directory (how editors resolve it).
        let first = text.lines().next().unwrap_or_default();
        let relative = first.strip_prefix(MODELINE).unwrap_or_else(|| {
            panic!("{shown}: the first line should be `{MODELINE}<path to {SCHEMA_FILE}>`")
        });
        let target = file.parent().unwrap().join(relative.trim());
        assert_eq!(
            target.canonicalize().ok().as_ref(),
            Some(&schema_file),
            "{shown}: the modeline's {relative:?} does not lead to {SCHEMA_FILE}"
        );
        if let Err(e) = validator.check(&text) {
            panic!("{shown} does not pass the schema:\n{e}");
        }
    }
}

/// Each case: YAML, and whether it is a valid file. The schema and the parser must
/// both say so (the parser's cross-field rules, like an unknown upstream, are not
/// the schema's business, so no case here depends on them).
const CASES: &[(&str, bool)] = &[
    ("routes: []", true),
    ("{}", false),
    (
        "routes: [{name: a, respond: {status: 200}, limits: [{algorithm: gcra, rate: 5/s, burst: \"${BURST:-3}\"}]}]",
        true,
    ),
    (
        "server: {listen: \"${LISTEN:-127.0.0.1:8080}\", idle_timeout: 90s, max_request_body: 1MiB, max_header_bytes: 16384}\nroutes: []",
        true,
    ),
    ("server: {listen: localhost:8080}\nroutes: []", false),
    ("server: {idle_timeout: 90}\nroutes: []", false),
    ("server: {idle_timeout: 1w}\nroutes: []", false),
    ("server: {max_request_body: 1.5MiB}\nroutes: []", false),
    ("server: {listne: 0.0.0.0:8080}\nroutes: []", false),
    ("store: {backend: memcached}\nroutes: []", false),
    ("store: {on_error: retry}\nroutes: []", false),
    ("store: {memory: {max_keys: -1}}\nroutes: []", false),
    ("client_ip: {trusted_proxies: [10.0.0.0/8, \"::1\"]}\nroutes: []", true),
    ("client_ip: {trusted_proxies: [proxy.internal]}\nroutes: []", false),
    ("response_headers: [ietf, x-ratelimit]\nroutes: []", true),
    ("response_headers: [draft]\nroutes: []", false),
    ("deny: {status: 70000}\nroutes: []", false),
    (
        "routes: [{name: a, respond: {status: 200}, limits: [{algorithm: leaky_bucket, limit: 1, window: 1s}]}]",
        false,
    ),
    (
        "routes: [{name: a, respond: {status: 200}, limits: [{algorithm: fixed_window, limit: 1, window: 1s, burts: 2}]}]",
        false,
    ),
    (
        "routes: [{name: a, respond: {status: 200}, limits: [{algorithm: token_bucket, rate: 10/fortnight}]}]",
        false,
    ),
    (
        "routes: [{name: a, respond: {status: 200}, limits: [{algorithm: fixed_window, limit: 100, window: month}]}]",
        true,
    ),
    (
        "routes: [{name: a, respond: {status: 200}, limits: [{algorithm: fixed_window, limit: 100, window: monthly}]}]",
        false,
    ),
    (
        "routes: [{name: a, respond: {status: 200}, key: [ip, \"header:x-api-key\"]}]",
        true,
    ),
    ("routes: [{name: a, respond: {status: 200}, key: {header: x}}]", false),
    (
        "routes: [{name: a, match: {path_prefix: /v1/, methods: [GET], headers: {x-tenant: \"*\"}}, respond: {status: 200}}]",
        true,
    ),
    (
        "routes: [{name: a, match: {prefix: /v1/}, respond: {status: 200}}]",
        false,
    ),
    (
        "routes: [{name: a, respond: {status: 200}, limits: [{algorithm: fixed_window, limit: 1, window: 1s}], ban: {after: 3, within: 1m, for: 10m}}]",
        true,
    ),
    (
        "routes: [{name: a, respond: {status: 200}, limits: [{algorithm: fixed_window, limit: 1, window: 1s}], ban: {after: 3, within: 1m}}]",
        false,
    ),
    ("routes: [{respond: {status: 200}}]", false),
    // A section written empty, every line under it commented out, is its defaults.
    (
        "server:\n#  listen: 0.0.0.0:8080\nadmin:\nstore:\nclient_ip:\ndeny:\nupstreams:\nresponse_headers:\nroutes:\n",
        true,
    ),
    ("store:\n  memory:\n  on_error: allow\nroutes: []", true),
    (
        "server:\n  upgrades:\ndeny:\n  ips:\n  keys:\nroutes:\n  - name: a\n    match:\n    limits:\n    overrides:\n    respond:\n      status: 200\n      headers:\n",
        true,
    ),
    ("store: {memory: {max_keys: \"+5\"}}\nroutes: []", true),
    ("server: []\nroutes: []", false),
];

#[test]
fn the_schema_and_the_parser_agree() {
    let validator = Validator::new();
    for (yaml, valid) in CASES {
        let by_schema = validator.check(yaml);
        assert_eq!(by_schema.is_ok(), *valid, "schema on {yaml}: {by_schema:?}");
        let by_parser = sluice::config::parse(yaml, Path::new("rules.yaml"));
        assert_eq!(
            by_parser.is_ok(),
            *valid,
            "parser on {yaml}: {:?}",
            by_parser.err().map(|e| e.to_string())
        );
    }
}

/// Every field the schema knows, as the configuration reference (docs/configuration.md)
/// names it (`` `field` ``): a field added to the parser without documentation fails here.
#[test]
fn every_field_is_in_the_configuration_reference() {
    fn names(v: &serde_json::Value, out: &mut std::collections::BTreeSet<String>) {
        match v {
            serde_json::Value::Object(map) => {
                if let Some(serde_json::Value::Object(props)) = map.get("properties") {
                    out.extend(props.keys().cloned());
                }
                map.values().for_each(|v| names(v, out));
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| names(v, out)),
            _ => {}
        }
    }
    let schema: serde_json::Value = serde_json::from_str(&printed_schema()).unwrap();
    let mut fields = std::collections::BTreeSet::new();
    names(&schema, &mut fields);
    assert!(fields.len() >= 60, "{fields:?}");
    let reference = std::fs::read_to_string(root().join("docs/configuration.md")).unwrap();
    let missing: Vec<&String> = fields
        .iter()
        // `field`, or within a dotted path: `tls.cert`, `upstreams.NAME`.
        .filter(|f| {
            ![
                format!("`{f}`"),
                format!(".{f}`"),
                format!("`{f}."),
                format!(".{f}."),
            ]
            .iter()
            .any(|form| reference.contains(form.as_str()))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "not in docs/configuration.md: {missing:?}"
    );
}
