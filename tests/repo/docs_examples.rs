//! The configurations the documentation shows are ones sluice accepts: `sluice check`
//! (the debug binary) passes every file of `docs/examples/` and `config/`, and every
//! sluice configuration written out in a YAML block of `docs/*.md`; and each file of
//! `docs/examples/` is shown, the same apart from its comments, in `docs/`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::run_grouped;

const SLUICE: &str = env!("CARGO_BIN_EXE_sluice");

/// The top-level fields of `rules.yaml`.
const SLUICE_KEYS: &[&str] = &[
    "server",
    "admin",
    "store",
    "client_ip",
    "response_headers",
    "upstreams",
    "deny",
    "routes",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The files of `dir` (relative to the crate) whose names end with `ext`, sorted.
fn files(dir: &str, ext: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(root().join(dir))
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(ext))
        .collect();
    out.sort();
    out
}

/// `sluice check -c FILE`: its exit status and what it printed.
fn check(path: &Path) -> (Option<i32>, String, String) {
    let out = run_grouped(
        Command::new(SLUICE)
            .args(["check", "-c"])
            .arg(path)
            .env_remove("SLUICE_CONFIG")
            // The examples' `${VAR:-default}` take their defaults.
            .env_remove("SLUICE_LISTEN")
            .env_remove("SLUICE_ADMIN_LISTEN")
            .env_remove("REDIS_URL")
            .current_dir(root()),
    )
    .expect("sluice runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[track_caller]
fn assert_checks(path: &Path) {
    let (code, stdout, stderr) = check(path);
    assert_eq!(code, Some(0), "{}:\n{stderr}", path.display());
    assert!(
        stdout.starts_with(&format!("{}: ok (sha1 ", path.display())),
        "{}: {stdout}",
        path.display()
    );
}

/// The YAML blocks of a Markdown text: the lines between ```` ```yaml ```` and ```` ``` ````.
fn yaml_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut open: Option<String> = None;
    for line in markdown.lines() {
        let fence = line.trim_start();
        match &mut open {
            None if fence == "```yaml" => open = Some(String::new()),
            Some(block) if fence == "```" => {
                blocks.push(std::mem::take(block));
                open = None;
            }
            Some(block) => {
                block.push_str(line);
                block.push('\n');
            }
            None => {}
        }
    }
    assert!(open.is_none(), "a YAML block is not closed");
    blocks
}

/// A block that is a whole sluice configuration: it has `routes:`, and every
/// top-level field is one of `rules.yaml`'s (so Envoy's and other YAML is left out).
fn is_sluice_config(block: &str) -> bool {
    let top: Vec<&str> = block
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with([' ', '#', '-']))
        .filter_map(|l| l.split_once(':').map(|(k, _)| k))
        .collect();
    top.contains(&"routes") && top.iter().all(|k| SLUICE_KEYS.contains(k))
}

/// The YAML without its comments and blank lines, each line's end trimmed: what two
/// spellings of one configuration share. (No value in these files contains " #".)
fn without_comments(yaml: &str) -> String {
    yaml.lines()
        .map(|l| match l.find(" #") {
            Some(i) => &l[..i],
            None if l.trim_start().starts_with('#') => "",
            None => l,
        })
        .map(str::trim_end)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn every_example_and_configuration_file_passes_check() {
    let examples = files("docs/examples", ".yaml");
    let names: Vec<String> = examples
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["envoy-ratelimit.yaml", "nginx-limit-req.yaml"]);
    let configs = files("config", ".yaml");
    assert!(
        configs.iter().any(|p| p.ends_with("config/rules.yaml")),
        "{configs:?}"
    );
    for path in examples.iter().chain(&configs) {
        assert_checks(path);
    }
}

#[test]
fn every_configuration_in_the_docs_passes_check() {
    let dir = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for doc in files("docs", ".md") {
        let text = std::fs::read_to_string(&doc).unwrap();
        for (i, block) in yaml_blocks(&text).iter().enumerate() {
            if !is_sluice_config(block) {
                continue;
            }
            let name = format!(
                "{}-block{i}.yaml",
                doc.file_stem().unwrap().to_string_lossy()
            );
            let path = dir.path().join(name);
            std::fs::write(&path, block).unwrap();
            assert_checks(&path);
            checked += 1;
        }
    }
    // docs/migrating.md: the nginx and the Envoy translations.
    assert!(checked >= 2, "only {checked} configurations found in docs/");
}

#[test]
fn every_example_file_is_shown_in_the_docs() {
    let mut shown = Vec::new();
    for doc in files("docs", ".md") {
        let text = std::fs::read_to_string(&doc).unwrap();
        shown.extend(
            yaml_blocks(&text)
                .iter()
                .filter(|b| is_sluice_config(b))
                .map(|b| without_comments(b)),
        );
    }
    for example in files("docs/examples", ".yaml") {
        let text = std::fs::read_to_string(&example).unwrap();
        assert!(
            shown.contains(&without_comments(&text)),
            "{} differs from every configuration shown in docs/*.md (comments aside)",
            example.display()
        );
    }
}

#[test]
fn the_block_finder_tells_sluice_from_envoy() {
    let md = "text\n```yaml\n# a comment\nroutes:\n  - name: a\n    respond: {}\n```\n\n```yaml\nroutes:\n  - match: {prefix: /}\nhttp_filters: []\n```\n```nginx\nroutes:\n```\n";
    let blocks = yaml_blocks(md);
    assert_eq!(blocks.len(), 2);
    assert!(is_sluice_config(&blocks[0]));
    assert!(!is_sluice_config(&blocks[1]));
    assert_eq!(
        without_comments("# x\nroutes:   # y\n\n  - name: a\n"),
        "routes:\n  - name: a"
    );
}
