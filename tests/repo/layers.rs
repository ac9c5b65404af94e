//! The layers of ARCHITECTURE.md, checked: each top-level module of `src/` imports
//! only the layers listed before it, so no two import each other, directly or
//! through others.

use std::path::{Path, PathBuf};

/// Lowest first, as ARCHITECTURE.md lists them; `fuzzing` may use everything.
const LAYERS: &[&str] = &[
    "http",
    "identity",
    "telemetry",
    "redis",
    "limit",
    "deny",
    "upstream",
    "jwt",
    "pipeline",
    "config",
    "rls",
    "ops",
    "server",
    "cli",
    "fuzzing",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a source folder") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules a file's code names as `crate::X` (comments left out).
fn imports(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let names: Vec<&str> = if let Some(group) = rest.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                group[..end].split(',').collect()
            } else {
                vec![rest]
            };
            for n in names {
                let n: String = n
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !n.is_empty() {
                    found.push(n);
                }
            }
        }
    }
    found
}

#[test]
fn every_layer_imports_only_the_layers_before_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut wrong = Vec::new();
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(&src).expect("src/") {
        let path = entry.expect("an entry").path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if name == "lib" || name == "main" {
            continue;
        }
        let rank = LAYERS.iter().position(|l| *l == name).unwrap_or_else(|| {
            panic!("src/{name} is in no layer: add it to ARCHITECTURE.md and LAYERS")
        });
        seen.push(name.clone());
        let mut files = Vec::new();
        if path.is_dir() {
            rust_files(&path, &mut files);
        } else {
            files.push(path.clone());
        }
        for file in files {
            let text = std::fs::read_to_string(&file).expect("a source file");
            for m in imports(&text) {
                if let Some(r) = LAYERS.iter().position(|l| *l == m) {
                    if r > rank {
                        wrong.push(format!(
                            "{} imports {m}, a layer above {name}",
                            file.strip_prefix(&src).unwrap().display()
                        ));
                    }
                }
            }
        }
    }
    wrong.sort();
    wrong.dedup();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // Every layer listed exists, and ARCHITECTURE.md names each.
    let architecture =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("ARCHITECTURE.md"))
            .expect("ARCHITECTURE.md");
    for l in LAYERS {
        assert!(seen.iter().any(|s| s == l), "LAYERS names {l}, not in src/");
        assert!(
            architecture.contains(&format!("`{l}")),
            "ARCHITECTURE.md does not name {l}"
        );
    }
}

/// The layers that may name the HTTP/1 codec (`http::h1`): `http` itself, the
/// servers that run it (`server`) and forwarding, which speaks it to upstreams
/// (`upstream`). `fuzzing` is the codec's own harness: its targets drive `h1`'s
/// parsers directly, so it names them too.
const SPEAK_H1: &[&str] = &["http", "server", "upstream", "fuzzing"];

/// Whether a file's code (comments left out) names `h1` as a path: `h1::…`, or
/// `h1` in a `{…}` group.
fn names_h1(text: &str) -> bool {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.lines().any(|line| {
        let code = line.split("//").next().unwrap_or("");
        let path = code
            .match_indices("h1::")
            .any(|(at, _)| !code[..at].chars().next_back().is_some_and(is_ident));
        let grouped = code.split('{').skip(1).any(|group| {
            let group = group.split('}').next().unwrap_or("");
            group.split(',').any(|item| {
                let item = item.trim();
                item == "h1" || item.starts_with("h1 as ")
            })
        });
        path || grouped
    })
}

/// Only `http`, `server` and `upstream` know how HTTP/1 is framed: the request
/// path, the admin API and every other layer work on `http::Request`/`Response`
/// and the body types of `http::request`.
#[test]
fn only_the_codec_layers_name_h1() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut wrong = Vec::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let layer = top.trim_end_matches(".rs");
        if SPEAK_H1.contains(&layer) {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("a source file");
        if names_h1(&text) {
            wrong.push(format!("src/{} names http::h1", rel.display()));
        }
    }
    wrong.sort();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn h1_is_found_in_paths_and_groups_not_comments() {
    assert!(names_h1("use crate::http::h1::server::Lent;\n"));
    assert!(names_h1("let d = h1::decode::Decoder::chunked();\n"));
    assert!(names_h1("use crate::http::{body, h1};\n"));
    assert!(!names_h1(
        "// `h1::server` reads it\n/// (`http::h1::upstream`)\n"
    ));
    assert!(!names_h1(
        "use crate::http::request::{declared_length, ClientBody};\n"
    ));
    assert!(!names_h1(
        "fn h1(length: Option<u64>) {}\nlet x = sha1::digest;\n"
    ));
}

#[test]
fn imports_are_read_from_paths_and_groups_not_comments() {
    let text = "use crate::http::body::Body;\nuse crate::{deny, limit::Store};\n// crate::server\nlet x = crate::pipeline::handle; // crate::ops\n";
    assert_eq!(imports(text), ["http", "deny", "limit", "pipeline"]);
}
