//! The configurations the documentation shows are ones sluice accepts: `sluice check`
//! (the debug binary) passes every file of `docs/examples/` and `config/`, and every
//! sluice configuration written out in a YAML block of `README.md` or `docs/*.md`; and
//! each file of `docs/examples/` is shown, the same apart from its comments, in
//! `docs/`. Every relative link of the documentation leads to a file of the
//! repository, and every `#anchor` to a heading of its page; the README stays short.

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
    "access_log",
    "rls",
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

/// The documentation's pages: `README.md`, `ARCHITECTURE.md` when there is one, and
/// `docs/*.md`.
fn pages() -> Vec<PathBuf> {
    let mut out = vec![root().join("README.md")];
    let architecture = root().join("ARCHITECTURE.md");
    if architecture.exists() {
        out.push(architecture);
    }
    out.extend(files("docs", ".md"));
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
    assert_eq!(
        names,
        [
            "abusers.yaml",
            "envoy-ratelimit.yaml",
            "grpc.yaml",
            "nginx-limit-req.yaml"
        ]
    );
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
    for doc in pages() {
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
    // README.md's first rules.yaml, docs/configuration.md's every field, and
    // docs/migrating.md's nginx and Envoy translations.
    assert!(
        checked >= 4,
        "only {checked} configurations found in README.md and docs/"
    );
}

#[test]
fn every_example_file_is_shown_in_the_docs() {
    let mut shown = Vec::new();
    for doc in pages() {
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

// === links ===

/// The lines of `markdown` outside fenced code blocks, with their numbers (from 1).
fn prose_lines(markdown: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in markdown.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fenced = !fenced;
        } else if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// The anchor GitHub gives a heading: lower case, every character but letters,
/// digits, `-`, `_` and spaces dropped, spaces turned into `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a page's headings, in order; a repeated one gets `-1`, `-2`, ...
/// as on GitHub.
fn anchors(markdown: &str) -> Vec<String> {
    let mut seen = std::collections::HashMap::<String, usize>::new();
    let mut out = Vec::new();
    for (_, line) in prose_lines(markdown) {
        let hashes = line.len() - line.trim_start_matches('#').len();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(line[hashes..].trim().trim_end_matches('#'));
        let n = seen.entry(base.clone()).or_insert(0);
        out.push(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// The link targets of a page outside code (fenced blocks and `code spans`, which
/// may run over lines of a paragraph), with their line numbers: inline
/// `[text](target)` and reference `[name]: target`.
fn links(markdown: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    // The length of the backtick run that opened the code span we are in.
    let mut span: Option<usize> = None;
    for (n, line) in prose_lines(markdown) {
        if line.trim().is_empty() {
            span = None;
            continue;
        }
        let mut prose = String::new();
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            if c != '`' {
                if span.is_none() {
                    prose.push(c);
                }
                continue;
            }
            let mut run = 1;
            while chars.next_if_eq(&'`').is_some() {
                run += 1;
            }
            span = match span {
                None => Some(run),
                Some(open) if open == run => None,
                open => open,
            };
        }
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            // `(target "title")`: the target is the first word.
            if let Some(target) = rest[..end].split_whitespace().next() {
                out.push((n, target.trim_matches(['<', '>']).to_string()));
            }
            rest = &rest[end..];
        }
        if let Some((name, target)) = prose.trim_start().split_once("]: ") {
            if name.starts_with('[') && !name.contains(']') {
                if let Some(target) = target.split_whitespace().next() {
                    out.push((n, target.to_string()));
                }
            }
        }
    }
    out
}

/// What is wrong with the link `target` of the page `page`, if anything.
fn broken(page: &Path, target: &str) -> Option<String> {
    let scheme = target.split_once(':').is_some_and(|(s, _)| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c))
    });
    if scheme {
        return None; // https:, mailto: ...
    }
    let (path, anchor) = match target.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (target, None),
    };
    let file = if path.is_empty() {
        page.to_path_buf()
    } else {
        page.parent().unwrap().join(path)
    };
    let Ok(file) = file.canonicalize() else {
        return Some(format!("{} does not exist", file.display()));
    };
    if !file.starts_with(root().canonicalize().unwrap()) {
        return Some(format!("{} is outside the repository", file.display()));
    }
    let anchor = anchor?;
    if file.extension().is_none_or(|e| e != "md") {
        return None;
    }
    let text = std::fs::read_to_string(&file).unwrap();
    let known = anchors(&text);
    (!known.iter().any(|a| a == anchor))
        .then(|| format!("no heading of {} has the anchor #{anchor}", file.display()))
}

#[test]
fn every_relative_link_leads_to_a_file_and_heading_that_exist() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for (line, target) in links(&text) {
            checked += 1;
            if let Some(problem) = broken(&page, &target) {
                problems.push(format!(
                    "{}:{line}: ({target}): {problem}",
                    page.strip_prefix(root()).unwrap().display()
                ));
            }
        }
    }
    assert!(checked >= 50, "only {checked} links found");
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_readme_is_at_most_300_lines() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 300,
        "README.md has {lines} lines: move detail into docs/"
    );
}

#[test]
fn the_link_finder_and_anchors_follow_github() {
    let md = "# Redis and fleets\n## `on_error`\n## What a failover does, *step by step*\n\
              ## Limits\n## Limits\n```sh\n# not a heading [x](nowhere.md)\n```\n\
              See [a](b.md#c \"title\") and `[code](no.md)`, ``a `[x](y.md)` b``, `over\n\
              a line [z](z.md)`, [d](#limits-1).\n[ref]: e/f.md\n";
    assert_eq!(
        anchors(md),
        [
            "redis-and-fleets",
            "on_error",
            "what-a-failover-does-step-by-step",
            "limits",
            "limits-1"
        ]
    );
    let found: Vec<String> = links(md).into_iter().map(|(_, t)| t).collect();
    assert_eq!(found, ["b.md#c", "#limits-1", "e/f.md"]);
    assert_eq!(
        slug("Admin API and command line"),
        "admin-api-and-command-line"
    );
    assert_eq!(slug("`sluice deny`"), "sluice-deny");
    assert_eq!(
        slug("Memory and `maxmemory-policy`"),
        "memory-and-maxmemory-policy"
    );
    let readme = root().join("README.md");
    assert!(broken(&readme, "https://example.com/x#y").is_none());
    assert!(broken(&readme, "docs/configuration.md#every-field").is_none());
    assert!(broken(&readme, "docs/configuration.md#no-such-heading").is_some());
    assert!(broken(&readme, "docs/no-such-page.md").is_some());
    assert!(broken(&readme, "../shared/STYLE.md").is_some());
}

/// The README's first example: six requests to `/hello` in a row get five 200s and
/// then a 429, wherever the loop falls against the limit's window. (With a fixed
/// 10-second window, a loop that crossed the window's end got six 200s.) The
/// route's plan is compiled from the README's own block and decided by the memory
/// store the example runs on, under a clock driven across a window's end.
#[tokio::test]
async fn the_readmes_first_example_gives_five_200s_then_a_429_wherever_the_loop_falls() {
    use sluice::limit::memory::MemoryStore;
    use sluice::limit::ManualClock;

    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let block = yaml_blocks(&readme)
        .into_iter()
        .find(|b| is_sluice_config(b) && b.contains("path: /hello"))
        .expect("the README shows a configuration with the /hello route");
    let loaded = sluice::config::parse(&block, Path::new("README.md")).expect("it parses");
    let metrics = sluice::telemetry::metrics::Metrics::new();
    let runtime = sluice::config::compile::compile(&loaded, &metrics, None).expect("it compiles");
    let hello = runtime.routes.iter().find(|r| r.name == "hello").unwrap();
    let plan = &hello
        .limits
        .as_ref()
        .expect("/hello is limited")
        .default
        .plan;

    const MS: u64 = 1_000;
    // A whole number of days since the epoch: every window that divides a day
    // ends at `day` (the loop's requests are 20 ms apart, as a shell's curls are).
    let day = 20_834 * 86_400_000 * MS;
    for start in (0..=120).map(|i| day - 110 * MS + i * MS) {
        let clock = ManualClock::new(start);
        let store = MemoryStore::new(1000, clock.clone());
        let got: Vec<u16> = (0..6)
            .map(|i| {
                clock.set(start + i * 20 * MS);
                let c = store.acquire(&hello.ns, "127.0.0.1", plan);
                if c.verdict.allowed {
                    200
                } else {
                    429
                }
            })
            .collect();
        assert_eq!(
            got,
            [200, 200, 200, 200, 200, 429],
            "six requests from {} ms before a window's end",
            (day - start.min(day)) / MS
        );
    }
}
